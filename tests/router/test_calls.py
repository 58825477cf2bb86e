"""Calls in flight to an engine found unreachable end at once, with an error.

First the mechanism alone (a read that never returns stands for a silent
engine), then through a proxy on each engine pool, the engine marked
unreachable on the proxy's loop as the health probe would (the real
partition across namespaces: ``test_calls_partition.py``), and engines that
are only busy, draining or refusing connections, which keep their streams
(a probe or a request's connect that timed out cuts only when a fresh
connect times out too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from fabric.router import state as state_module
from fabric.router.calls import EngineCalls, EngineUnreachable
from fabric.router.state import ProxyState
from fabric.testing.fake_engine import FakeEngineConfig, create_fake_engine

from .conftest import StartEngine, StartProxy
from .servers import Proxy, ServerThread, dead_url, full_accept_queue
from .test_early_handoff import decoder, early_proxy
from .test_pd_flow import COMPLETION, assert_answered

LONG_STREAM = {**COMPLETION, "max_tokens": 100_000, "stream": True}  # 0.05 s a token: hours


async def silent_read() -> None:
    """A read from an engine that sends nothing, ever."""
    await asyncio.get_running_loop().create_future()


async def start_reading(calls: EngineCalls) -> asyncio.Task[None]:
    """A task in a read window of a call, reading from a silent engine."""

    async def call() -> None:
        with calls.reading():
            await silent_read()

    task = asyncio.create_task(call())
    await asyncio.sleep(0)
    return task


def test_a_cut_ends_a_pending_read_at_once() -> None:
    async def main() -> None:
        calls = EngineCalls()
        task = await start_reading(calls)
        assert len(calls) == 1
        assert calls.cut("no TCP connection within 3 s") == 1
        with pytest.raises(EngineUnreachable, match="no TCP connection within 3 s"):
            await asyncio.wait_for(task, 5)
        assert (len(calls), calls.cut_total) == (0, 1)
        assert calls.cut("again") == 0  # nothing in flight

    asyncio.run(main())


def test_a_cut_while_sending_is_raised_by_the_next_read() -> None:
    """A stream's task sending a chunk to the client is not interrupted."""

    async def main() -> None:
        calls = EngineCalls()
        sending, sent = asyncio.Event(), asyncio.Event()
        done: list[str] = []

        async def stream() -> None:
            call = calls.open()
            try:
                with call:
                    await asyncio.sleep(0)  # a read
                    call.reading = False
                    sending.set()
                    await sent.wait()  # the send to the client
                    done.append("sent")
                    call.resume()
                    await silent_read()
            finally:
                call.close()

        task = asyncio.create_task(stream())
        await sending.wait()
        assert calls.cut("gone") == 1
        await asyncio.sleep(0.01)
        assert not task.done()
        sent.set()
        with pytest.raises(EngineUnreachable):
            await asyncio.wait_for(task, 5)
        assert done == ["sent"] and len(calls) == 0

    asyncio.run(main())


def test_another_cancel_at_the_same_time_stays_a_cancel() -> None:
    """The client left (or the deadline passed) as the engine was cut."""

    async def main() -> None:
        calls = EngineCalls()
        task = await start_reading(calls)
        task.cancel()
        calls.cut("gone")
        with pytest.raises(asyncio.CancelledError):
            await task

        async def deadline() -> str:
            try:
                async with asyncio.timeout(0.01) as timeout:
                    with calls.reading():
                        when = timeout.when()
                        assert when is not None
                        # NOTE: due together: both fire before the task resumes
                        asyncio.get_running_loop().call_at(when, calls.cut, "gone")
                        await silent_read()
            except TimeoutError:
                return "timed out"
            return "not reached"

        assert await asyncio.wait_for(deadline(), 5) == "timed out"
        assert len(calls) == 0

    asyncio.run(main())


def test_a_call_ending_by_another_cancel_is_not_counted() -> None:
    """Its task was cancelled before the cut (a client that left, a prefill
    leg its engine's mark_down cancelled): that cancel ends it, the cut does
    not count it (failed on the old code: counted 2)."""

    async def main() -> None:
        calls = EngineCalls()
        leaving, staying = await start_reading(calls), await start_reading(calls)
        leaving.cancel()
        assert calls.cut("gone") == 1
        with pytest.raises(asyncio.CancelledError):
            await leaving
        with pytest.raises(EngineUnreachable):
            await asyncio.wait_for(staying, 5)
        assert (len(calls), calls.cut_total) == (0, 1)

    asyncio.run(main())


# --- through a proxy ---------------------------------------------------------


def on_loop(proxy: Proxy, read: Callable[[ProxyState], Any]) -> Any:
    """``read(state)`` on the proxy's event loop."""

    async def call(state: ProxyState) -> Any:
        return read(state)

    return proxy.run(call)


def cut_when_calling(proxy: Proxy, name: str) -> None:
    """Once ``name`` has a call in flight, mark it unreachable as the probe does."""
    deadline = time.monotonic() + 20
    while not on_loop(proxy, lambda state: len(state.engine(name).calls)):
        assert time.monotonic() < deadline, f"no call to {name}"
        time.sleep(0.01)
    on_loop(proxy, lambda state: state.engine(name).mark_unreachable("test: partitioned"))


def assert_cut_clean(proxy: Proxy) -> None:
    """Once the request ended: one call cut, every table empty, nothing outstanding."""
    deadline = time.monotonic() + 20
    while any(tables := on_loop(proxy, lambda state: state.tables()).values()):
        # NOTE: an early handoff's last word may still be on its way
        assert time.monotonic() < deadline, f"tables not emptied: {tables}"
        time.sleep(0.01)
    state = proxy.state
    assert state.counter_values()["calls_cut"] == 1
    assert [e.outstanding for e in state.pool.engines] == [0] * len(state.pool.engines)


def post_in_thread(url: str, body: dict[str, Any]) -> Callable[[], httpx.Response]:
    """POST ``body`` from a thread; the returned function waits for the answer."""
    answers: list[httpx.Response | httpx.HTTPError] = []

    def post() -> None:
        with httpx.Client(timeout=20, trust_env=False) as client:
            try:
                answers.append(client.post(url, json=body))
            except httpx.HTTPError as exc:
                answers.append(exc)

    thread = threading.Thread(target=post)
    thread.start()

    def answer() -> httpx.Response:
        thread.join(30)
        [response] = answers
        assert isinstance(response, httpx.Response), f"no answer: {response!r}"
        return response

    return answer


def assert_became_unreachable(error: dict[str, Any], name: str) -> None:
    assert error["type"] == "upstream_error", error
    assert f"{name} (" in error["message"], error
    assert "became unreachable: test: partitioned" in error["message"], error


def test_a_stream_from_an_unreachable_decoder_ends_with_an_error_event(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", token_delay_s=0.05)
    proxy = start_proxy([p.url], [d.url])

    with (
        httpx.Client(timeout=20, trust_env=False) as client,
        client.stream("POST", f"{proxy.url}/v1/completions", json=LONG_STREAM) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        cut_when_calling(proxy, "decode-0")
        events = []
        deadline = time.monotonic() + 20  # NOTE: uncut, the stream goes on for hours
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
            if time.monotonic() > deadline:
                break

    assert_became_unreachable(json.loads(events[-1])["error"], "decode-0")
    assert response.status_code == 200
    assert_cut_clean(proxy)
    assert proxy.state.counters.decode_errors == 1


@pytest.mark.parametrize(("early", "stream"), [(False, False), (True, False), (True, True)])
def test_a_decode_waiting_on_an_unreachable_decoder_is_a_502(
    start_engine: StartEngine, start_proxy: StartProxy, early: bool, stream: bool
) -> None:
    """D computes (slowly); or, admitted at dispatch (early handoff), D waits
    for P's word while P computes (slowly). Either way no byte came yet."""
    if early:
        p = start_engine("prefill", delay_s=60)
        d, kv_port = decoder(start_engine)
        proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)])
    else:
        p, d = start_engine("prefill"), start_engine("decode", delay_s=60)
        proxy = start_proxy([p.url], [d.url])

    answer = post_in_thread(f"{proxy.url}/v1/completions", {**COMPLETION, "stream": stream})
    cut_when_calling(proxy, "decode-0")
    response = answer()

    assert response.status_code == 502
    assert_became_unreachable(response.json()["error"], "decode-0")
    assert_cut_clean(proxy)
    assert proxy.state.counters.early_handoffs == int(early)


def test_a_prefill_on_an_unreachable_prefiller_falls_back(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d = start_engine("prefill", delay_s=60), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])

    answer = post_in_thread(f"{proxy.url}/v1/completions", COMPLETION)
    cut_when_calling(proxy, "prefill-0")
    response = answer()

    assert_answered(response, COMPLETION)
    assert "kv_transfer_params" not in d.seen[0]["body"]
    assert proxy.state.counters.fallbacks == 1
    assert_cut_clean(proxy)


@pytest.mark.parametrize("trouble", ["busy", "draining"])
def test_a_busy_or_draining_decoder_keeps_its_stream(
    start_engine: StartEngine, start_proxy: StartProxy, trouble: str
) -> None:
    """Busy: its probes time out, a fresh connection is made (3 in a row mark it
    down); draining: its probes answer 503. Neither is unreachable. (A
    draining engine whose probe times out: the test below.)"""
    busy = trouble == "busy"
    p = start_engine("prefill")
    d = start_engine("decode", gated=True, token_delay_s=0.05, health_delay_s=5.0 if busy else 0.0)
    proxy = start_proxy(
        [p.url], [d.url], health_interval_s=0.1, health_timeout_s=0.2, decode_timeout_s=10
    )
    body = {**LONG_STREAM, "max_tokens": 60}  # 3 s

    events = []
    with (
        httpx.Client(timeout=20, trust_env=False) as client,
        client.stream("POST", f"{proxy.url}/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                d.gate.draining = not busy
        engine = proxy.state.engine("decode-0")
        down = (engine.healthy, engine.draining)

    assert events[-1] == "[DONE]" and len(events) == 61, events[-1]
    assert down == ((False, False) if busy else (False, True)), proxy.state.engine("decode-0")
    assert proxy.state.counter_values()["calls_cut"] == 0


class HangsOnHealth:
    """An engine's ASGI app that, once ``armed``, takes the next ``/health``
    as its way out: it stops listening (fresh connections are refused, the
    open ones go on), and that ``/health`` answers only once its probe
    timed out."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.server: ServerThread | None = None
        self.armed = False
        self.hung = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.armed and scope["type"] == "http" and scope["path"] == "/health":
            self.armed = False
            assert self.server is not None
            self.server.stop_listening()
            self.hung.set()
            await asyncio.sleep(1.0)  # the probe gives up after 0.2 s
        await self.app(scope, receive, send)


@pytest.mark.parametrize("draining", [False, True])
def test_a_decoder_that_times_out_then_refuses_keeps_its_stream(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    servers: list[ServerThread],
    caplog: pytest.LogCaptureFixture,
    draining: bool,
) -> None:
    """Its probe times out, then the fresh connect is refused (a process
    restarting, a Service without ready endpoints): down for new requests,
    its stream goes on; draining too (drained through the proxy, its probes
    do not answer the drain 503: they time out as well).

    Failed on the old code: a refused connect after a timed-out probe read
    as unreachable and cut the stream."""
    p = start_engine("prefill")
    app = HangsOnHealth(create_fake_engine(FakeEngineConfig(role="decode", token_delay_s=0.05)))
    d = app.server = ServerThread(app).start()
    servers.append(d)
    proxy = start_proxy(
        [p.url], [d.url], health_interval_s=0.1, health_timeout_s=0.2, decode_timeout_s=10
    )
    body = {**LONG_STREAM, "max_tokens": 60}  # 3 s

    events = []
    with (
        caplog.at_level(logging.WARNING, "fabric.router.engines"),
        httpx.Client(timeout=20, trust_env=False) as client,
        client.stream("POST", f"{proxy.url}/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    if draining:
                        on_loop(proxy, lambda state: state.set_draining("decode-0"))
                    app.armed = True
        engine = proxy.state.engine("decode-0")
        down = (engine.healthy, engine.draining)

    assert app.hung.is_set()
    [marked] = [r.getMessage() for r in caplog.records if "marked down" in r.getMessage()]
    assert "/health: ReadTimeout" in marked and "refused" in marked, marked
    assert events[-1] == "[DONE]" and len(events) == 61, events[-1]
    assert down == (False, draining), proxy.state.engine("decode-0")
    assert proxy.state.counter_values()["calls_cut"] == 0


@pytest.mark.parametrize("fresh", ["refused", "timed out"])
def test_a_connect_timeout_cuts_when_the_fresh_connect_times_out_too(
    start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch, fresh: str
) -> None:
    """A request's connect timed out (ProxyState.connect_failed): the fresh
    connect in the background cuts the decoder's calls if it times out too,
    not if it is refused (failed on the old code: it cut them)."""
    monkeypatch.setattr(state_module, "UNREACHABLE_CONNECT_S", 0.5)
    with contextlib.ExitStack() as stack:
        url = dead_url() if fresh == "refused" else stack.enter_context(full_accept_queue())
        proxy = start_proxy([dead_url()], [url], health_timeout_s=0.2)

        async def check(state: ProxyState) -> tuple[bool, str]:
            engine = state.engine("decode-0")
            reading = await start_reading(engine.calls)
            request = httpx.Request("POST", url)
            state.connect_failed(engine, httpx.ConnectTimeout("timed out", request=request))
            await asyncio.gather(*state._reach_checks.values())  # its background connect
            await asyncio.sleep(0.01)
            if reading.done():
                return engine.healthy, repr(reading.exception())
            reading.cancel()
            return engine.healthy, "reading"

        healthy, ended = proxy.run(check)
    assert not healthy
    if fresh == "refused":
        assert ended == "reading"
        assert proxy.state.counter_values()["calls_cut"] == 0
    else:
        assert ended.startswith("EngineUnreachable('ConnectTimeout: timed out; no TCP"), ended
        assert proxy.state.counter_values()["calls_cut"] == 1


@pytest.mark.parametrize("down_before", [False, True])
def test_an_early_prefill_leg_cut_is_counted_once(
    start_engine: StartEngine, start_proxy: StartProxy, down_before: bool
) -> None:
    """mark_down cancels a prefiller's early legs; mark_unreachable cuts its
    calls: a leg in flight is counted once, as cut. One that a mark_down
    before had cancelled already ended by that cancel: not counted. Either
    way the decoder is told and computes the prompt."""
    p = start_engine("prefill", delay_s=60)
    d, kv_port = decoder(start_engine)
    proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)])

    answer = post_in_thread(f"{proxy.url}/v1/completions", COMPLETION)
    deadline = time.monotonic() + 20
    while not on_loop(proxy, lambda state: len(state.engine("prefill-0").calls)):
        assert time.monotonic() < deadline, "no prefill leg"
        time.sleep(0.01)

    def cut(state: ProxyState) -> None:
        engine = state.engine("prefill-0")
        if down_before:
            engine.mark_down("test: refused")
        engine.mark_unreachable("test: partitioned")

    on_loop(proxy, cut)
    assert_answered(answer(), COMPLETION)
    assert proxy.state.counter_values()["calls_cut"] == int(not down_before)
    assert proxy.state.counters.early_handoffs == 1
