"""The proxy's store calls: one bound per caller, side by side, a silent store skipped.

The store here is a real ZMQ ROUTER on a free port that reads every request
and answers only when told to (a store that never answers: a hung engine);
the requests it has not answered yet are held, and answered once it is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from fabric.config import parse_topology
from fabric.errors import PeerUnreachable
from fabric.router import stores
from fabric.router.stores import CLIENTS_PER_ENDPOINT, StoreCalls, StoreSkipped
from fabric.transfer import protocol as proto

from .conftest import StartEngine
from .servers import Proxy, ServerThread

BOUND_MS = 1000
PROMPT = list(range(100, 180))


class SilentStore:
    """A ROUTER that counts the requests it reads and answers them only while
    ``answer`` (Stats: ``{"filled": 1}``, Lookup: no hit); ``lookups`` holds
    the token ids of every Lookup read, ``most_held`` the most requests it
    held unanswered at once."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.port = port
        self.codec = proto.Codec()
        self.received = 0
        self.answered = 0
        self.answer = False
        self.lookups: list[tuple[int, ...]] = []
        self.held: list[tuple[bytes, proto.Message]] = []
        self.most_held = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.answer:
                while self.held:
                    self._reply(*self.held.pop(0))
            if not self.sock.poll(20):
                continue
            identity, frame = self.sock.recv_multipart()
            request = self.codec.decode(frame)
            if isinstance(request, proto.Lookup):
                self.lookups.append(tuple(request.token_ids))
            self.received += 1
            self.held.append((identity, request))
            self.most_held = max(self.most_held, len(self.held))

    def _reply(self, identity: bytes, request: proto.Message) -> None:
        reply: proto.Message
        if isinstance(request, proto.Lookup):
            reply = proto.LookupResult(request.seq, request.request_id, 16, 0, 0, False)
        else:
            reply = proto.StatsReply(request.seq, {"filled": 1})  # type: ignore[union-attr]
        self.sock.send_multipart([identity, self.codec.encode(reply)])
        self.answered += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)
        self.context.term()


@pytest.fixture
def silent() -> Iterator[SilentStore]:
    store = SilentStore()
    yield store
    store.close()


def cache_aware_proxy(
    servers: list[ServerThread], prefill_url: str, decode_url: str, kv_port: int, bound_ms: int
) -> Proxy:
    data = {
        "prefill": [{"name": "p0", "url": prefill_url}],
        "decode": [{"name": "d0", "url": decode_url, "kv_port": kv_port}],
        "proxy": {
            "port": None,
            "health_interval_s": 0,
            "policy": "cache_aware",
            "lookup_timeout_ms": bound_ms,
        },
    }
    proxy = Proxy(parse_topology(data, source="test")).start()
    servers.append(proxy)
    return proxy


def send_all(url: str, bodies: list[dict[str, object]]) -> list[int]:
    """POST every body at once; their statuses."""

    async def go() -> list[int]:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            calls = [client.post(f"{url}/v1/completions", json=body) for body in bodies]
            return [r.status_code for r in await asyncio.gather(*calls)]

    return asyncio.run(go())


def timed_store_calls(proxy: Proxy) -> list[float]:
    """Record how long each of the proxy's store calls kept its caller waiting."""
    calls = proxy.state.stores
    waits: list[float] = []
    call = calls.call

    async def timed(endpoint: str, method: str, *args: Any, **kw: Any) -> Any:
        started = time.monotonic()
        try:
            return await call(endpoint, method, *args, **kw)
        finally:
            waits.append(time.monotonic() - started)

    calls.call = timed  # type: ignore[method-assign]
    return waits


def bodies(n: int) -> list[dict[str, object]]:
    """``n`` cache-aware requests whose prompts differ in their last token."""
    return [{"model": "fake", "prompt": [*PROMPT, i], "max_tokens": 2} for i in range(n)]


def test_concurrent_lookups_of_one_store_are_sent_side_by_side(
    start_engine: StartEngine, servers: list[ServerThread], silent: SilentStore
) -> None:
    """32 cache-aware requests at once: the store holds its answers until it
    has CLIENTS_PER_ENDPOINT lookups to answer at once (or a hang guard
    passed), then answers everything. It gets there: lookups of concurrent
    requests reach one store side by side, not one after another behind one
    client (which the store would see as one lookup at a time); and each
    request sent exactly one lookup."""
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = cache_aware_proxy(servers, p.url, d.url, silent.port, bound_ms=120_000)

    def release() -> None:
        deadline = time.monotonic() + 30
        while silent.most_held < CLIENTS_PER_ENDPOINT and time.monotonic() < deadline:
            time.sleep(0.01)
        silent.answer = True

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    statuses = send_all(proxy.url, bodies(32))
    releaser.join(60)

    assert statuses == [200] * 32
    assert silent.most_held == CLIENTS_PER_ENDPOINT
    assert sorted(silent.lookups) == sorted(tuple(b["prompt"]) for b in bodies(32))  # type: ignore[arg-type]


def test_concurrent_cache_aware_requests_each_wait_one_bound_for_a_silent_store(
    start_engine: StartEngine, servers: list[ServerThread], silent: SilentStore
) -> None:
    """32 cache-aware requests at once while D's store never answers: every
    request is answered; each sent at most one lookup, and only a few reach
    the store at all (the first ones time out together, then the store is
    skipped). A sanity guard on each store call's own wait (its bound plus
    a generous slack): 32 lookups queued one after another took 32 bounds."""
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = cache_aware_proxy(servers, p.url, d.url, silent.port, bound_ms=BOUND_MS)
    waits = timed_store_calls(proxy)

    statuses = send_all(proxy.url, bodies(32))

    assert statuses == [200] * 32
    assert len(d.seen) == 32
    assert silent.answered == 0  # it never answered: no request waited for it to
    assert len(set(silent.lookups)) == len(silent.lookups)  # at most one per request
    assert silent.received <= 2 * CLIENTS_PER_ENDPOINT, silent.received
    assert len(waits) == 32  # one store call per request (d0's; p0 has no kv_port)
    assert max(waits) < BOUND_MS / 1000 + 20  # a sanity guard, not a bound


def test_decoders_that_start_draining_during_the_lookups_are_a_503(
    start_engine: StartEngine, servers: list[ServerThread], silent: SilentStore
) -> None:
    """The only decoder starts draining while the request waits for its
    store's answer: the client gets the same 503 as when it was draining
    before (before: a 500, the policy found no decoder to pick)."""
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = cache_aware_proxy(servers, p.url, d.url, silent.port, bound_ms=120_000)

    async def drain(state: Any) -> None:
        state.set_draining("d0", True)

    url = f"{proxy.url}/v1/completions"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, url, json=bodies(1)[0], timeout=60)
        deadline = time.monotonic() + 30
        while silent.received < 1:
            assert time.monotonic() < deadline, "the lookup never reached the store"
            time.sleep(0.01)
        proxy.run(drain)
        silent.answer = True
        response = sent.result(60)

    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and "every one is draining" in error["message"]
    assert d.seen == [] and p.seen == []


def test_a_store_that_keeps_timing_out_is_skipped_then_tried_again(
    silent: SilentStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stores, "BACKOFF_BASE_S", 0.5)

    async def scenario() -> None:
        calls = StoreCalls(200)
        try:
            for _ in range(stores.BACKOFF_AFTER):
                with pytest.raises(PeerUnreachable) as info:
                    await calls.call(silent.endpoint, "stats")
                assert not isinstance(info.value, StoreSkipped)
            while calls.in_flight:  # the calls' threads end on their own bound
                await asyncio.sleep(0.01)
            with pytest.raises(StoreSkipped, match="skipped"):
                await calls.call(silent.endpoint, "stats")
            assert silent.received == stores.BACKOFF_AFTER  # skipped: nothing sent
            assert calls.backing_off(silent.endpoint)
            await asyncio.sleep(0.6)  # past the backoff: one call tries it again
            silent.answer = True
            assert (await calls.call(silent.endpoint, "stats")) == {"filled": 1}
            while calls.in_flight:
                await asyncio.sleep(0.01)
            assert not calls.backing_off(silent.endpoint)
            assert (await calls.call(silent.endpoint, "stats")) == {"filled": 1}
            assert calls.timeouts == stores.BACKOFF_AFTER and calls.skipped == 1
        finally:
            await calls.close()

    asyncio.run(scenario())


def test_callers_past_the_clients_of_a_store_wait_at_most_one_bound(
    silent: SilentStore,
) -> None:
    """More callers than clients: the extra ones wait for a client, but never
    past their own bound from the moment they asked."""

    async def scenario() -> list[BaseException | object]:
        calls = StoreCalls(300, clients_per_endpoint=1)
        try:
            results = await asyncio.gather(
                *(calls.call(silent.endpoint, "stats") for _ in range(3)),
                return_exceptions=True,
            )
            assert calls.waiting == 0
            return results
        finally:
            await calls.close()

    started = time.monotonic()
    results = asyncio.run(scenario())

    assert all(isinstance(r, PeerUnreachable) for r in results)
    assert any("no free client" in str(r) for r in results)
    assert silent.received == 1  # one client: the others never sent
    assert time.monotonic() - started < 10  # hang guard


def test_a_store_answering_again_is_used_at_once_after_one_timeout(
    silent: SilentStore,
) -> None:
    async def scenario() -> None:
        calls = StoreCalls(200)
        try:
            with pytest.raises(PeerUnreachable):
                await calls.call(silent.endpoint, "stats")
            while calls.in_flight:
                await asyncio.sleep(0.01)
            silent.answer = True
            assert not calls.backing_off(silent.endpoint)  # one timeout is not a backoff
            assert (await calls.call(silent.endpoint, "stats")) == {"filled": 1}
        finally:
            await calls.close()

    asyncio.run(scenario())


class BrokenClient:
    """A store client whose every call fails in the client (no answer)."""

    error: Exception = OSError("socket closed")

    def __init__(self, endpoint: str, **options: Any) -> None:
        self.endpoint = endpoint

    def stats(self) -> dict[str, int]:
        raise self.error

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "error", [OSError("socket closed"), zmq.ZMQError(zmq.ENOTSOCK)], ids=["os", "zmq"]
)
def test_a_call_failing_in_the_client_counts_as_no_answer(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """ZMQ and socket errors reach the caller as PeerUnreachable and count
    toward the backoff (before: raw, and taken for an answer: a store
    failing so was never skipped)."""
    monkeypatch.setattr(stores, "StoreClient", BrokenClient)
    monkeypatch.setattr(BrokenClient, "error", error)

    async def scenario() -> None:
        calls = StoreCalls(200)
        try:
            for _ in range(stores.BACKOFF_AFTER):
                with pytest.raises(PeerUnreachable, match="stats failed"):
                    await calls.call("tcp://127.0.0.1:1", "stats")
            assert calls.backing_off("tcp://127.0.0.1:1")
            with pytest.raises(StoreSkipped):
                await calls.call("tcp://127.0.0.1:1", "stats")
        finally:
            await calls.close()

    asyncio.run(scenario())


def test_an_endpoint_not_asked_for_a_while_is_dropped_and_its_clients_closed(
    silent: SilentStore,
) -> None:
    """A shared store restarted on a new port: its old endpoint's clients
    would reconnect forever. After ``idle_s`` without a call, the next call
    (to any store) drops it and closes its clients in a pool thread."""
    silent.answer = True
    other = SilentStore()
    other.answer = True

    async def scenario() -> tuple[list[str], list[str], list[zmq.Socket[bytes] | None]]:
        calls = StoreCalls(1000, idle_s=0.2)
        try:
            await calls.call(silent.endpoint, "stats")
            before = calls.endpoints
            clients = [c._sock for e in calls._endpoints.values() for c in e.clients]
            await asyncio.sleep(0.3)  # past idle_s
            await calls.call(other.endpoint, "stats")
            return before, calls.endpoints, clients
        finally:
            await calls.close()

    try:
        before, after, sockets = asyncio.run(scenario())
    finally:
        other.close()

    assert before == [silent.endpoint] and after == [other.endpoint]
    assert sockets and all(sock is not None and sock.closed for sock in sockets)


def test_a_forgotten_endpoint_is_dropped_at_the_next_call(silent: SilentStore) -> None:
    silent.answer = True
    other = SilentStore()
    other.answer = True

    async def scenario() -> list[str]:
        calls = StoreCalls(1000)
        try:
            await calls.call(silent.endpoint, "stats")
            calls.forget(silent.endpoint)
            await calls.call(other.endpoint, "stats")
            return calls.endpoints
        finally:
            await calls.close()

    try:
        assert asyncio.run(scenario()) == [other.endpoint]
    finally:
        other.close()
