"""The shared store service: engines attach, push chunks, look up and fetch.

The service runs in-process (its own control loop, data plane and fetch
thread) and, once, as ``fabric store serve`` in a subprocess. "Engines" are
TransferNodes with a reuse tier, as a vLLM worker builds them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fabric.errors import LayoutMismatch, PeerUnreachable, TransferError
from fabric.shared_store.service import MAX_SLOTS, ServiceConfig, SharedStore
from fabric.store import ChunkStore, StoreConfig
from fabric.store.tier import TieredStore
from fabric.transfer import TransferConfig, TransferNode
from fabric.transfer import protocol as proto
from fabric.transfer.nixl_plane import nixl_available
from fabric.transfer.store_client import StoreClient

FINGERPRINT = "fp-service-test"
CHUNK_TOKENS = 4
CHUNK_BYTES = 8192
ENGINE_SLOTS = 16

TRANSPORTS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl")),
]


class Engine:
    """What a worker owns: a store with its reuse tier, served on a TransferNode."""

    def __init__(self, transport: str, fingerprint: str = FINGERPRINT) -> None:
        self.store = ChunkStore(StoreConfig(slot_bytes=CHUNK_BYTES, num_slots=ENGINE_SLOTS))
        self.tier = TieredStore(self.store, chunk_tokens=CHUNK_TOKENS, fingerprint=fingerprint)
        config = TransferConfig(transport=transport, ucx_net_devices="lo")  # type: ignore[arg-type]
        self.node = TransferNode(self.store, config, fingerprint, tier=self.tier)
        self.fingerprint = fingerprint

    @property
    def endpoint(self) -> str:
        return self.node.endpoint

    def compute(self, tokens: list[int]) -> list[int]:
        """Pack every full chunk of ``tokens`` (bytes derived from its key); slots, held."""
        slots = []
        for key in self.tier.keys(tokens):
            slot = self.store.allocate(key)
            self.store.pool.memoryview(slot, CHUNK_BYTES)[:] = chunk_payload(key)
            self.store.commit(slot, key, CHUNK_BYTES)
            slots += self.store.acquire([key])
        return slots

    def chunk(self, key: bytes) -> bytes | None:
        slots = self.store.acquire([key])
        if not slots:
            return None
        try:
            return bytes(self.store.pool.memoryview(slots[0], CHUNK_BYTES))
        finally:
            self.store.release_slots(slots)

    def close(self) -> None:
        self.node.close()
        self.tier.close()


def chunk_payload(key: bytes) -> bytes:
    return (key * (CHUNK_BYTES // len(key) + 1))[:CHUNK_BYTES]


def tokens(n_chunks: int, seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(n_chunks * CHUNK_TOKENS + 1)]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., object]]:
    """``make("service", transport, **config)`` / ``make("engine", transport)``; all closed."""
    made: list[SharedStore | Engine] = []

    def factory(kind: str, transport: str = "tcp", **kwargs: object) -> object:
        if kind == "service":
            config = ServiceConfig(
                mem_bytes=kwargs.pop("mem_bytes", 64 * CHUNK_BYTES),  # type: ignore[arg-type]
                transport=transport,  # type: ignore[arg-type]
                ucx_net_devices="lo",
                push_timeout_s=5.0,
                **kwargs,  # type: ignore[arg-type]
            )
            made.append(SharedStore(config).start())
        else:
            made.append(Engine(transport, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield factory
    for thing in reversed(made):
        thing.close()


def attach(service: SharedStore, engine: Engine) -> None:
    with StoreClient(service.endpoint) as client:
        client.attach(engine.fingerprint, CHUNK_TOKENS, CHUNK_BYTES, engine.endpoint)


def save(service: SharedStore, engine: Engine, request_id: str, prompt: list[int]) -> int:
    """Push ``prompt``'s chunks as a worker does; returns how many the store lacked."""
    slots = engine.compute(prompt)
    keys = engine.tier.keys(prompt)
    try:
        link = engine.node.client.connect(service.endpoint)
        res = link.push(request_id, keys, slots, timeout=5.0)
    finally:
        engine.store.release_slots(slots)
    wait_present(service, prompt)
    return len(res.missing)


def wait_present(service: SharedStore, prompt: list[int], timeout: float = 10) -> None:
    """Written bytes are verified off the control loop: wait until all are in."""
    want = len(prompt) // CHUNK_TOKENS
    deadline = time.monotonic() + timeout
    with StoreClient(service.endpoint) as client:
        while client.lookup(prompt).hit_chunks < want:
            assert time.monotonic() < deadline, "pushed chunks never became present"
            time.sleep(0.02)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_chunks_saved_by_one_engine_are_fetched_into_another(make, transport: str) -> None:
    service = make("service", transport)
    a, b = make("engine", transport), make("engine", transport)
    attach(service, a)
    prompt = tokens(5, seed=1)
    assert save(service, a, "save-1", prompt) == 5

    with StoreClient(service.endpoint) as client:
        assert client.lookup(prompt).hit_chunks == 5
        attach(service, b)
        reply = client.fetch("fetch-1", prompt, b.endpoint, min_chunks=0)
    assert (reply.hit_chunks, reply.pushing, reply.chunk_tokens) == (5, True, CHUNK_TOKENS)

    progress = b.node.server.wait("fetch-1", timeout=10)
    assert progress is not None and progress.complete, progress
    b.node.server.release("fetch-1")
    for key in b.tier.keys(prompt):
        assert b.chunk(key) == chunk_payload(key)  # every byte, verified by checksum too
    assert b.tier.lookup(prompt).chunks == 5  # they stay in B's store for reuse
    with StoreClient(service.endpoint) as client:
        deadline = time.monotonic() + 10  # the fetch thread counts once its write is done
        while (stats := client.stats())["service_fetch_pushes"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert stats["service_fetched_chunks"] == 5 and stats["service_fetch_failures"] == 0


def test_saving_the_same_chunks_again_moves_nothing(make) -> None:
    service = make("service")
    a, b = make("engine"), make("engine")
    attach(service, a)
    attach(service, b)
    prompt = tokens(4, seed=2)
    longer = prompt[:-1] + tokens(2, seed=3)  # shares the first 4 chunks
    assert save(service, a, "a-1", prompt) == 4
    assert save(service, b, "b-1", prompt) == 0  # Reserve answered: all present
    assert save(service, b, "b-2", longer) == 2
    with StoreClient(service.endpoint) as client:
        assert client.lookup(longer).hit_chunks == 6
        assert client.stats()["filled"] == 6


def test_a_push_into_the_store_is_let_go_once_verified(make) -> None:
    """Nobody reads a push into the shared store: its reservation and progress
    entry go once it is verified, and its chunks stay in the store."""
    service = make("service")
    a = make("engine")
    attach(service, a)
    prompt = tokens(3, seed=6)
    save(service, a, "a-1", prompt)
    with StoreClient(service.endpoint) as client:
        deadline = time.monotonic() + 10
        while (stats := client.stats())["tables.server_progress"] or stats["reserved"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
        assert client.lookup(prompt).hit_chunks == 3


def test_fetch_pushes_nothing_unless_the_store_holds_more(make) -> None:
    service = make("service")
    a, b = make("engine"), make("engine")
    attach(service, a)
    attach(service, b)
    prompt = tokens(3, seed=4)
    save(service, a, "a-1", prompt)
    with StoreClient(service.endpoint) as client:
        reply = client.fetch("f-1", prompt, b.endpoint, min_chunks=3)
        assert (reply.hit_chunks, reply.pushing) == (3, False)
        assert client.stats()["holds"] == 0  # nothing left referenced
        miss = client.fetch("f-2", tokens(3, seed=5), b.endpoint)
        assert (miss.hit_chunks, miss.pushing) == (0, False)
    assert b.node.server.wait("f-1", timeout=0.3) is None  # no reservation ever came


def test_a_mismatched_engine_is_refused_naming_the_field(make) -> None:
    service = make("service")
    a = make("engine")
    other = make("engine", fingerprint="another-layout")
    attach(service, a)
    with StoreClient(service.endpoint) as client:
        with pytest.raises(LayoutMismatch, match="fingerprint"):
            client.attach("another-layout", CHUNK_TOKENS, CHUNK_BYTES, other.endpoint)
        with pytest.raises(LayoutMismatch, match="chunk_bytes"):
            client.attach(FINGERPRINT, CHUNK_TOKENS, CHUNK_BYTES * 2, other.endpoint)
        with pytest.raises(LayoutMismatch, match="chunk_tokens"):
            client.attach(FINGERPRINT, CHUNK_TOKENS * 2, CHUNK_BYTES, other.endpoint)
        # never attached: the store will not push into it
        with pytest.raises(TransferError, match="not_attached"):
            client.fetch("f-1", tokens(1, seed=6), other.endpoint)
        assert client.stats()["service_attach_refused"] == 3
    with pytest.raises(LayoutMismatch):  # its data plane cannot say Hello either
        other.node.client.connect(service.endpoint)


def test_an_unbound_store_refuses_hello_and_fetch(make) -> None:
    service = make("service")
    a = make("engine")
    with pytest.raises(LayoutMismatch, match="Attach first"):
        a.node.client.connect(service.endpoint)
    with StoreClient(service.endpoint) as client:
        with pytest.raises(TransferError, match="unbound"):
            client.fetch("f-1", tokens(1, seed=7), a.endpoint)
        # a chunk bigger than all the memory: refused, and the store stays unbound
        with pytest.raises(LayoutMismatch, match="larger than the whole region"):
            client.attach(FINGERPRINT, CHUNK_TOKENS, 10**9, a.endpoint)
        # a chunk of no tokens, no layout
        with pytest.raises(LayoutMismatch, match="chunk_tokens: 0 is outside"):
            client.attach(FINGERPRINT, 0, CHUNK_BYTES, a.endpoint)
        with pytest.raises(LayoutMismatch, match="fingerprint: must not be empty"):
            client.attach("", CHUNK_TOKENS, CHUNK_BYTES, a.endpoint)
        assert client.stats()["service_attach_refused"] == 3
    # a chunk of one byte: millions of slots
    big = make("service", mem_bytes=(MAX_SLOTS + 1) * 4)
    with StoreClient(big.endpoint) as client:
        with pytest.raises(LayoutMismatch, match=r"chunk_bytes: 1 would make \d+ slots"):
            client.attach(FINGERPRINT, CHUNK_TOKENS, 1, a.endpoint)
        assert client.stats()["service_attach_refused"] == 1
    attach(service, a)
    assert save(service, a, "a-1", tokens(2, seed=7)) == 2


def test_fetch_to_a_dead_engine_fails_bounded_and_counts(make) -> None:
    service = make("service")
    a, b = make("engine"), make("engine")
    attach(service, a)
    attach(service, b)
    prompt = tokens(2, seed=8)
    save(service, a, "a-1", prompt)
    b.close()
    started = time.monotonic()
    with StoreClient(service.endpoint) as client:
        assert client.fetch("f-1", prompt, b.endpoint).pushing
        while client.stats()["service_fetch_failures"] == 0:
            assert time.monotonic() - started < 15, "the failed fetch was never counted"
            time.sleep(0.1)
        assert client.stats()["holds"] == 0  # the chunks it held were let go
        assert client.lookup(prompt).hit_chunks == 2  # and are still served


def test_a_dead_shared_store_costs_one_bounded_call(make) -> None:
    service = make("service")
    endpoint = service.endpoint
    service.close()
    client = StoreClient(endpoint, timeout_ms=200)
    started = time.monotonic()
    with pytest.raises(PeerUnreachable):
        client.fetch("f-1", tokens(1, seed=9), "tcp://127.0.0.1:1")
    assert time.monotonic() - started < 2
    client.close()


def test_disk_tier_outlives_the_store_process(make, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = make("service", disk_path=str(disk), disk_gib=0.01)
    a = make("engine")
    attach(first, a)
    prompt = tokens(3, seed=10)
    save(first, a, "a-1", prompt)
    first.close()  # flushes the disk writer
    assert len(list(disk.rglob("*.chunk"))) == 3

    second = make("service", disk_path=str(disk), disk_gib=0.01)
    b = make("engine")
    attach(second, b)
    with StoreClient(second.endpoint) as client:
        reply = client.fetch("f-1", prompt, b.endpoint)
    assert (reply.hit_chunks, reply.pushing) == (3, True)
    progress = b.node.server.wait("f-1", timeout=10)
    assert progress is not None and progress.complete
    assert all(b.chunk(k) == chunk_payload(k) for k in b.tier.keys(prompt))


def test_fabric_store_serve_cli_writes_its_endpoint_and_stops_on_sigterm(tmp_path: Path) -> None:
    endpoint_file = tmp_path / "store.endpoint"
    log = tmp_path / "store.log"
    argv = [sys.executable, "-m", "fabric.cli", "store", "serve", "--mem-gib", "0.01"]
    argv += ["--transport", "tcp", "--endpoint-file", str(endpoint_file)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not endpoint_file.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        endpoint = endpoint_file.read_text().strip()
        with StoreClient(endpoint) as client:
            stats = client.stats()
        assert stats["num_slots"] == 1 and stats["service_attaches"] == 0
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not endpoint_file.exists()
    assert f"serving on {endpoint}" in log.read_text()


def test_a_fetch_whose_lease_ran_out_in_the_queue_is_not_pushed(make) -> None:
    """A Fetch that waited in the offload queue past its lease is answered
    without a push: its hold is let go, nothing is reserved on the engine."""
    service = make("service")
    a, b = make("engine"), make("engine")
    attach(service, a)
    attach(service, b)
    prompt = tokens(3, seed=8)
    save(service, a, "a-1", prompt)
    gate, started = threading.Event(), threading.Semaphore(0)

    def parked() -> proto.Message:
        started.release()
        assert gate.wait(60), "the test never opened the gate"
        return proto.Done(0, 0)

    lease_ms = 200
    fetched: list[object] = []
    with StoreClient(service.endpoint, timeout_ms=60_000) as client:
        try:
            for _ in range(2):  # NOTE: both offload threads busy: the Fetch waits its turn
                assert service.server.defer(b"nobody", 0, parked) is None
                assert started.acquire(timeout=30)
            fetcher = threading.Thread(
                target=lambda: fetched.append(
                    client.fetch("f-late", prompt, b.endpoint, lease_ms=lease_ms)
                ),
                daemon=True,
            )
            fetcher.start()
            deadline = time.monotonic() + 30
            while service.server.table_sizes()["server_offload"] < 3:
                assert time.monotonic() < deadline, "the Fetch never reached the queue"
                time.sleep(0.01)
            time.sleep(2 * lease_ms / 1000)  # NOTE: its lease runs out while it waits
        finally:
            gate.set()
        fetcher.join(60)
        [reply] = fetched
        assert isinstance(reply, proto.Fetching)
        assert (reply.hit_chunks, reply.pushing) == (3, False)
        stats = client.stats()
    assert stats["service_fetch_expired"] == 1 and stats["service_fetch_pushes"] == 0
    assert stats["holds"] == 0 and stats["tables.store_referenced_slots"] == 0
    assert b.node.server.wait("f-late", timeout=0.3) is None  # no reservation ever came


def test_an_idle_store_wakes_a_few_times_a_second_not_hundreds(make) -> None:
    """It runs beside the host's engines, each on one core: nothing
    outstanding, its loop sleeps until a control message (at most
    IDLE_POLL_MS). A count, not a time: a busy box only makes it wake less."""
    from fabric.shared_store.service import IDLE_POLL_MS
    from tests.transfer.patterns import loop_wakeups

    service = make("service", "tcp")
    steps = loop_wakeups(service.server)
    assert 0 < steps <= 1000 / IDLE_POLL_MS + 10  # NOTE: 5 ms polls: ~200
