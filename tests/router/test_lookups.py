"""The proxy's store calls: one bound per caller, side by side, a silent store skipped.

The store here is a real ZMQ ROUTER on a free port that reads every request
and answers only when told to (a store that never answers: a hung engine).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

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
    """A ROUTER that counts the requests it reads; answers Stats only when ``answer``."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.port = port
        self.codec = proto.Codec()
        self.received = 0
        self.answer = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            identity, frame = self.sock.recv_multipart()
            self.received += 1
            if self.answer:
                request = self.codec.decode(frame)
                reply = proto.StatsReply(request.seq, {"filled": 1})  # type: ignore[union-attr]
                self.sock.send_multipart([identity, self.codec.encode(reply)])

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


def test_concurrent_cache_aware_requests_each_wait_one_bound_for_a_silent_store(
    start_engine: StartEngine, servers: list[ServerThread], silent: SilentStore
) -> None:
    """32 cache-aware requests at once while D's store never answers: every
    request is answered, and at most a few lookups reach that store (the
    first ones time out together, then the store is skipped); before, the
    lookups queued behind one client's lock, one bound each, and all 32
    reached it."""
    p, d = start_engine("prefill"), start_engine("decode")
    data = {
        "prefill": [{"name": "p0", "url": p.url}],
        "decode": [{"name": "d0", "url": d.url, "kv_port": silent.port}],
        "proxy": {
            "port": None,
            "health_interval_s": 0,
            "policy": "cache_aware",
            "lookup_timeout_ms": BOUND_MS,
        },
    }
    proxy = Proxy(parse_topology(data, source="test")).start()
    servers.append(proxy)
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": 2}

    async def send_all() -> list[int]:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            calls = [client.post(f"{proxy.url}/v1/completions", json=body) for _ in range(32)]
            return [r.status_code for r in await asyncio.gather(*calls)]

    started = time.monotonic()
    statuses = asyncio.run(send_all())
    elapsed = time.monotonic() - started

    assert statuses == [200] * 32
    assert len(d.seen) == 32
    assert silent.received <= 2 * CLIENTS_PER_ENDPOINT, silent.received
    assert elapsed < 30  # a hang guard only: 32 lookups one after the other took 32 bounds


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
