"""Engine states for whoever runs the engines: draining, down, and the control API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from fabric.router.engines import Engine, EngineState
from fabric.router.state import ProxyState

from .conftest import StartEngine, StartProxy
from .servers import ServerThread
from .test_pd_flow import COMPLETION, sse_events
from .test_prefix_routes import PROMPT, Store, start, stores  # noqa: F401 (fixture)


def wait_for(check: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Until ``check()`` is true (a hang guard only)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_draining_decoder_finishes_its_stream_gets_nothing_new_and_drains(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p = start_engine("prefill")
    d0, d1 = start_engine("decode", token_delay_s=0.05), start_engine("decode")
    proxy = start_proxy([p.url], [d0.url, d1.url])
    decoder = proxy.state.pool.decoders[0]
    url = f"{proxy.url}/v1/completions"
    body = {**COMPLETION, "stream": True, "max_tokens": 40}

    def stream() -> list[str]:
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            return sse_events(b"".join(response.iter_raw()).decode())

    async def drain(state: ProxyState) -> tuple[int, bool]:
        state.set_draining("decode-0", True)
        during = state.engine("decode-0").outstanding
        return during, await state.wait_drained("decode-0", 30)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream)  # round robin: decode-0
        wait_for(lambda: decoder.outstanding == 1, "the stream never reached decode-0")
        drained = pool.submit(proxy.run, drain)
        wait_for(lambda: decoder.draining, "the drain was not applied")
        others = [httpx.post(url, json=COMPLETION, timeout=10) for _ in range(4)]
        events = streamed.result()
        during, done = drained.result()

    assert (during, done) == (1, True)
    assert events[-1] == "[DONE]" and len(events) == 41  # the in-flight stream went on
    assert [r.status_code for r in others] == [200] * 4
    assert (len(d0.seen), len(d1.seen)) == (1, 4)
    assert decoder.outstanding == 0 and decoder.state is EngineState.DRAINING
    status = httpx.get(f"{proxy.url}/fabric/status", timeout=10).json()
    assert status["engines"][1]["state"] == "draining"
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    assert 'fabric_proxy_engine_draining{engine="decode-0",role="decode"} 1\n' in metrics


def test_wait_drained_is_bounded_while_a_request_holds_the_engine(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", delay_s=2.0)
    proxy = start_proxy([p.url], [d.url])

    async def drain(state: ProxyState) -> bool:
        state.set_draining("decode-0", True)
        return await state.wait_drained("decode-0", 0.3)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{proxy.url}/v1/completions", json=COMPLETION, timeout=30)
        deadline = time.monotonic() + 10
        while proxy.state.pool.decoders[0].outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.run(drain) is False
        assert held.result().status_code == 200  # the request it held was served
    assert proxy.run(lambda state: state.wait_drained("decode-0", 5)) is True


def test_draining_engines_are_never_picked(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])

    async def drain(state: ProxyState, name: str, on: bool) -> None:
        state.set_draining(name, on)

    proxy.run(lambda state: drain(state, "prefill-0", True))
    local = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)
    proxy.run(lambda state: drain(state, d.url, True))  # by URL
    refused = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)
    proxy.run(lambda state: drain(state, "decode-0", False))
    proxy.run(lambda state: drain(state, "prefill-0", False))
    again = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)

    assert local.status_code == 200 and "kv_transfer_params" not in d.seen[0]["body"]
    assert refused.status_code == 503
    assert "draining" in refused.json()["error"]["message"]
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert again.status_code == 200 and len(p.seen) == 1
    assert proxy.state.counters.fallbacks == 1


def test_the_control_api_names_engines_by_name_or_url_and_refuses_others(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    state = proxy.state

    assert state.engine("decode-0") is state.engine(d.url) is state.engine(d.url + "/")
    with pytest.raises(LookupError, match=r"no engine named 'decode-9'.*decode-0"):
        state.engine("decode-9")


def test_status_shows_a_down_engine_as_down_since_without_its_store_numbers(
    start_engine: StartEngine,
    servers: list[ServerThread],
    stores: list[Store],  # noqa: F811
    client: httpx.Client,
) -> None:
    """D's store still answers, but D is down: its numbers are unknown, not shown."""
    stores[2].hold_chunks(PROMPT, 2)
    proxy, _ = start(start_engine, servers, stores)
    before = {e["name"]: e for e in client.get(f"{proxy.url}/fabric/status").json()["engines"]}

    async def down(state: ProxyState) -> float:
        return state.mark_down("d0", "its process exited").since

    since = proxy.run(down)
    after = {e["name"]: e for e in client.get(f"{proxy.url}/fabric/status").json()["engines"]}

    assert before["d0"]["state"] == "up" and before["d0"]["store"]["filled"] == 2
    d0 = after["d0"]
    assert (d0["state"], d0["healthy"], d0["store"]) == ("down", False, None)
    assert d0["error"] == "its process exited" and d0["since"] == since
    assert abs(since - time.time()) < 60
    assert after["p0"]["store"]["filled"] == 0  # the others are still asked


def test_outstanding_is_exact_and_wait_idle_wakes_when_it_reaches_zero() -> None:
    async def scenario() -> list[Any]:
        engine = Engine("d0", "decode", "http://d0", None)
        engine.outstanding += 2
        waiter = asyncio.ensure_future(engine.wait_idle(10))
        await asyncio.sleep(0)
        engine.outstanding -= 1
        await asyncio.sleep(0)
        pending = not waiter.done()
        engine.outstanding -= 1
        return [pending, await waiter, await engine.wait_idle(0)]

    assert asyncio.run(scenario()) == [True, True, True]
    engine = Engine("d0", "decode", "http://d0", None)
    with pytest.raises(AssertionError, match="outstanding would be -1"):
        engine.outstanding -= 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_decoder_refusing_with_its_drain_503_is_marked_draining_and_replaced(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, stream: bool
) -> None:
    """D0's gate refuses (it got SIGTERM; nobody told the proxy yet): the
    request goes to D1, which computes the prompt, and D0 gets nothing new.
    Before, the client got D0's 503 although D1 was free."""
    p = start_engine("prefill")
    d0, d1 = start_engine("decode", gated=True), start_engine("decode")
    proxy = start_proxy([p.url], [d0.url, d1.url])
    d0.gate.draining = True
    url = f"{proxy.url}/v1/completions"
    body = {**COMPLETION, "stream": stream}

    first = client.post(url, json=body)  # round robin: decode-0 first
    others = [client.post(url, json=body) for _ in range(3)]

    assert first.status_code == 200, first.text
    assert [r.status_code for r in others] == [200] * 3
    assert d0.seen == [] and len(d1.seen) == 4
    assert "kv_transfer_params" not in d1.seen[0]["body"]  # its KV went to decode-0
    counters = proxy.state.counters
    assert (counters.drain_refusals, counters.fallbacks) == (1, 1)
    engine = proxy.state.engine("decode-0")
    assert engine.state is EngineState.DRAINING
    status = client.get(f"{proxy.url}/fabric/status").json()
    assert status["engines"][1]["state"] == "draining"


def test_a_drain_seen_ends_when_the_engine_answers_its_probe_again(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """Its /health 503 while it drains also marks it draining (so the proxy
    can be ready without it); once it answers /health again (restarted,
    or its drain called off) it is routed to again."""
    p = start_engine("prefill")
    d0, d1 = start_engine("decode", gated=True), start_engine("decode")
    proxy = start_proxy([p.url], [d0.url, d1.url])
    d0.gate.draining = True

    assert proxy.run(lambda state: state.wait_ready(30)) == []
    assert proxy.state.engine("decode-0").draining

    d0.gate.draining = False
    assert proxy.run(lambda state: state.wait_ready(30)) == []
    engine = proxy.state.engine("decode-0")
    assert engine.state is EngineState.UP and not engine.draining
    for _ in range(2):
        assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200
    assert len(d0.seen) == 1


def test_a_drain_set_by_whoever_runs_the_engine_outlives_its_probes(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d0, d1 = start_engine("prefill"), start_engine("decode"), start_engine("decode")
    proxy = start_proxy([p.url], [d0.url, d1.url])

    async def drain_then_probe(state: ProxyState) -> bool:
        state.set_draining("decode-0", True)
        await state.probe_engines()  # decode-0 answers /health 200
        return state.engine("decode-0").draining

    assert proxy.run(drain_then_probe) is True


def test_a_prefiller_refusing_with_its_drain_503_is_marked_draining(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """The refused prefill falls back (D computes the prompt); the next
    requests go through the other prefiller, not to the draining one."""
    p0, p1 = start_engine("prefill", gated=True), start_engine("prefill")
    d = start_engine("decode")
    proxy = start_proxy([p0.url, p1.url], [d.url])
    p0.gate.draining = True

    statuses = [client.post(f"{proxy.url}/v1/completions", json=COMPLETION) for _ in range(4)]

    assert [r.status_code for r in statuses] == [200] * 4
    assert len(p1.seen) == 3 and proxy.state.counters.fallbacks == 1
    assert proxy.state.engine("prefill-0").draining
    assert proxy.state.counters.drain_refusals == 1
