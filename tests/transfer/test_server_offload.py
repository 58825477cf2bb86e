"""Offloaded lookups against releases and shutdown, with a real server and disk tier.

A Lookup that holds runs on an offload thread while it reads its chunks
back from disk (here one read is parked on a gate). Meanwhile:

- the request's hold is released (in-process, as the worker applies the
  scheduler's release, or by a Release on the server's loop): the lookup
  ends holding nothing, no slot stays referenced;
- the server closes: the queued lookup is answered ``closing`` at once,
  the running one is waited for and answered before the loop stops; past
  ``close_timeout_s`` close gives up, and the late lookup meets a closed
  tier (it keeps nothing).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fabric.errors import TransferError
from fabric.store import ChunkStore, StoreConfig
from fabric.store.disk import DiskTier
from fabric.store.tier import TieredStore
from fabric.transfer import TransferConfig, TransferNode, TransferServer
from fabric.transfer import protocol as proto
from fabric.transfer.config import open_data_plane
from fabric.transfer.dataplane import DataPlane
from fabric.transfer.offload import Offload
from fabric.transfer.store_client import StoreClient
from tests.store.parked import ParkedReads

from .patterns import FINGERPRINT

CT = 16
PROMPT = list(range(100, 100 + 3 * CT))  # 3 full chunks
OTHER = list(range(900, 900 + 3 * CT))
_names = itertools.count()


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[TieredStore]:
    """A reuse tier whose PROMPT and OTHER chunks are on disk only."""
    store = ChunkStore(StoreConfig(slot_bytes=4096, num_slots=16, quarantine_ms=10))
    t = TieredStore(
        store, chunk_tokens=CT, fingerprint=FINGERPRINT, disk=DiskTier(tmp_path, 1 << 24)
    )
    for key in t.keys(PROMPT) + t.keys(OTHER):
        slot = store.allocate(key)
        store.pool.slot_view(slot)[:256].fill_(7)
        store.commit(slot, key, 256)
    assert t.flush() and store.drop_unused() == 6
    yield t
    t.close()


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``fn`` on a thread; its result (or the exception it raised) lands in the list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def referenced(tier: TieredStore) -> int:
    return tier.store.table_sizes()["store_referenced_slots"]


@pytest.mark.parametrize("release_by", ["worker", "release_message"])
def test_a_release_that_overtakes_an_offloaded_lookup_leaves_no_hold(
    tier: TieredStore, monkeypatch: pytest.MonkeyPatch, release_by: str
) -> None:
    read = ParkedReads(tier, monkeypatch, tier.keys(PROMPT)[1])
    config = TransferConfig(transport="loopback")
    node = TransferNode(tier.store, config, FINGERPRINT, name=f"off-r{next(_names)}", tier=tier)
    assert node.server is not None
    client = StoreClient(node.endpoint, timeout_ms=60_000)
    other = StoreClient(node.endpoint, timeout_ms=30_000)
    try:
        lookup, answers = in_thread(lambda: client.lookup(PROMPT, hold="r"))
        try:
            assert read.parked.wait(30), "the lookup never read from disk"
            if release_by == "worker":
                assert not tier.release_hold("r")  # as the worker applies the scheduler's
            else:
                assert not other.release("r")  # answered on the loop meanwhile
        finally:
            read.gate.set()
            lookup.join(60)
        [answer] = answers
        assert isinstance(answer, proto.LookupResult)
        assert (answer.hit_chunks, answer.held) == (3, False)
        sizes = node.server.table_sizes()
        assert sizes["tier_holds"] == 0 and sizes["store_referenced_slots"] == 0
        assert other.stats()["tier_holds_cancelled"] == 1
        # The next lookup of that request holds again.
        assert client.lookup(PROMPT, hold="r").held
        assert other.release("r") and referenced(tier) == 0
    finally:
        client.close()
        other.close()
        node.close()


def loopback_server(tier: TieredStore, **kwargs: object) -> tuple[TransferServer, DataPlane]:
    config = TransferConfig(transport="loopback")
    plane = open_data_plane(config, f"off-s{next(_names)}")
    pool = tier.store.pool
    plane.register_pool(pool.base_address, pool.nbytes, str(pool.device))
    server = TransferServer(tier.store, plane, config, FINGERPRINT, tier=tier, **kwargs)  # type: ignore[arg-type]
    return server.start(), plane


def wait_offloaded(server: TransferServer, count: int) -> None:
    deadline = time.monotonic() + 30
    while server.table_sizes()["server_offload"] < count:
        assert time.monotonic() < deadline, "the lookups never reached the offload queue"
        time.sleep(0.01)


def test_close_answers_queued_work_and_waits_for_the_running_job(
    tier: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = ParkedReads(tier, monkeypatch, tier.keys(PROMPT)[1])
    offload = Offload(threads=1, max_queued=4)
    server, plane = loopback_server(tier, offload=offload, close_timeout_s=60)
    clients = [StoreClient(server.endpoint, timeout_ms=60_000) for _ in range(2)]
    try:
        running, ran = in_thread(lambda: clients[0].lookup(PROMPT, hold="r1"))
        assert read.parked.wait(30), "the first lookup never read from disk"
        queued, refused = in_thread(lambda: clients[1].lookup(OTHER, hold="r2"))
        wait_offloaded(server, 2)
        closer, _ = in_thread(server.close)
        try:
            queued.join(60)
            [error] = refused  # answered at once, while the first still runs
            assert isinstance(error, TransferError) and "closing" in str(error)
            assert closer.is_alive() and running.is_alive()  # close waits for it
        finally:
            read.gate.set()
        closer.join(60)
        running.join(60)
        [answer] = ran  # its reply was sent before the loop stopped
        assert isinstance(answer, proto.LookupResult) and answer.held
        assert not closer.is_alive()
    finally:
        read.gate.set()
        for client in clients:
            client.close()
        server.close()
        plane.close()
    assert tier.release_hold("r1") and referenced(tier) == 0


def test_close_gives_up_after_its_bound_and_the_late_job_keeps_nothing(
    tier: TieredStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    read = ParkedReads(tier, monkeypatch, tier.keys(PROMPT)[1])
    offload = Offload(threads=1, max_queued=4)
    server, plane = loopback_server(tier, offload=offload, close_timeout_s=0.2)
    client = StoreClient(server.endpoint, timeout_ms=2000)
    try:
        running, _ = in_thread(lambda: client.lookup(PROMPT, hold="r1"))
        assert read.parked.wait(30), "the lookup never read from disk"
        with caplog.at_level(logging.WARNING):
            server.close()  # NOTE: returns while the lookup is still parked
        assert "still running" in caplog.text
        assert offload.running() == 1
        tier.close()  # what the owner does next
    finally:
        read.gate.set()
    running.join(60)
    assert offload.wait_idle(30) and offload.close()  # now it ends, and its pipe closes
    assert tier.held_count() == 0 and referenced(tier) == 0  # the late hold was dropped
    client.close()
    plane.close()


def test_shutdown_answers_queued_jobs_and_refuses_new_ones() -> None:
    offload = Offload(threads=1, max_queued=4).start()
    started, gate = threading.Event(), threading.Event()

    def blocked() -> proto.Message:
        started.set()
        assert gate.wait(30)
        return proto.Done(1, 1)

    try:
        assert offload.submit(b"a", 1, blocked)
        assert started.wait(30)
        assert offload.submit(b"b", 2, blocked)
        assert offload.shutdown() == 1 and offload.closed
        assert not offload.submit(b"c", 3, blocked) and offload.busy == 0  # closed, not busy
        [(identity, reply)] = offload.take_done()
        assert identity == b"b" and isinstance(reply, proto.Refused)
        assert (reply.seq, reply.code) == (2, "closing")
        assert not offload.wait_idle(0.05)  # the running one is still running
        gate.set()
        assert offload.wait_idle(30)
        assert offload.take_done() == [(b"a", proto.Done(1, 1))] and offload.pending() == 0
    finally:
        gate.set()
        assert offload.close()
