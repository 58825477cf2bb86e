"""The transfer server's loop stays live while blocking work runs.

A real server with a real disk tier (thousands of chunk files under
tmp_path) is asked to Clear it, and the Clear is held in its unlinks (each
one slowed, and the first parked on a gate the test opens). Meanwhile a
sender says Hello, reserves, pushes over the data plane, heartbeats past
its lease, and a third client asks Stats and a Lookup: all answered, the
push verified, the lease alive. The Clear's answer comes once the gate
opens, and the chunks pushed meanwhile (written behind to disk) survive it.
"""

from __future__ import annotations

import itertools
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric.errors import TransferError
from fabric.store import ChunkStore, StoreConfig
from fabric.store.checksum import checksum
from fabric.store.disk import DiskTier
from fabric.store.tier import TieredStore
from fabric.transfer import TransferConfig, TransferNode, TransferServer
from fabric.transfer import protocol as proto
from fabric.transfer.config import open_data_plane
from fabric.transfer.offload import Offload
from fabric.transfer.store_client import StoreClient
from tests.store.parked import ParkedReads

from .patterns import FINGERPRINT, chunk_key, fill_store

SLOT = 16 << 10
FILES = 2000
LEASE_MS = 1500
_names = itertools.count()


class SlowUnlinks:
    """``Path.unlink`` of chunk files: slow, and the first parked until ``opened``."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.started = threading.Event()
        self.gate = threading.Event()
        self.count = 0

    def __call__(self, path: Path, missing_ok: bool = False) -> None:
        if path.suffix == ".chunk":
            self.count += 1
            self.started.set()
            assert self.gate.wait(60), "the test never opened the gate"
            time.sleep(1e-4)
        self.real(path, missing_ok=missing_ok)


@pytest.fixture
def unlinks(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowUnlinks]:
    slow = SlowUnlinks(Path.unlink)

    def unlink(path: Path, missing_ok: bool = False) -> None:
        slow(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    yield slow
    slow.gate.set()  # NOTE: whatever failed, let a parked Clear finish


def tier_with_files(tmp_path: Path) -> tuple[TieredStore, DiskTier]:
    """A reuse tier over a disk tier of ``FILES`` chunk files."""
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=32, quarantine_ms=10))
    disk = DiskTier(tmp_path / "disk", 1 << 30)
    payload = bytes(64)
    for i in range(FILES):
        assert disk.put(chunk_key(900, i), payload, checksum(payload))
    return TieredStore(store, chunk_tokens=16, fingerprint=FINGERPRINT, disk=disk), disk


def receiver_with_disk(
    tmp_path: Path, transport: str
) -> tuple[TransferNode, TieredStore, DiskTier]:
    tier, disk = tier_with_files(tmp_path)
    store = tier.store
    config = TransferConfig(transport=transport, poll_interval_ms=0.5)  # type: ignore[arg-type]
    node = TransferNode(store, config, FINGERPRINT, name=f"live-r{next(_names)}", tier=tier)
    return node, tier, disk


@pytest.mark.parametrize("transport", ["loopback", "tcp"])
def test_a_long_clear_of_the_disk_tier_leaves_pushes_and_leases_served(
    tmp_path: Path, unlinks: SlowUnlinks, transport: str
) -> None:
    receiver, tier, disk = receiver_with_disk(tmp_path, transport)
    assert receiver.server is not None
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=8, quarantine_ms=10))
    sender_config = TransferConfig(transport=transport, control_timeout_ms=3000)  # type: ignore[arg-type]
    sender = TransferNode(
        store, sender_config, FINGERPRINT, name=f"live-s{next(_names)}", serve=False
    )
    admin = StoreClient(receiver.endpoint, timeout_ms=60_000)
    probe = StoreClient(receiver.endpoint, timeout_ms=3000)
    cleared: list[int] = []
    clear = threading.Thread(target=lambda: cleared.append(admin.clear("disk")), daemon=True)
    try:
        clear.start()
        assert unlinks.started.wait(30), "the Clear never began unlinking"

        # While the Clear is parked: Hello, Reserve, write + notification, verify.
        keys, slots = fill_store(sender, 7, 3, SLOT)
        link = sender.client.connect(receiver.endpoint)
        res = link.reserve("r1", keys, [SLOT] * 3, lease_ms=LEASE_MS)
        link.write(res, range(3), slots).wait(10)
        prog = receiver.server.wait("r1", 10)
        assert prog is not None and prog.complete and not prog.expired
        # Heartbeats answered past the original lease: the reservation lives on.
        deadline = time.monotonic() + 1.5 * LEASE_MS / 1000
        while time.monotonic() < deadline:
            assert link.heartbeat("r1", LEASE_MS)
            time.sleep(LEASE_MS / 5000)
        assert receiver.store.reservation("r1") is not None
        # Other control requests are answered too.
        stats = probe.stats()
        assert stats["server_chunks_filled"] == 3 and stats["tables.server_progress"] == 1
        assert probe.lookup([1] * 32).hit_chunks == 0
        assert clear.is_alive() and not cleared, "the Clear must still be parked here"
    finally:
        unlinks.gate.set()
        clear.join(60)
        admin.close()
        probe.close()
    try:
        assert cleared == [FILES]  # what was there when it began
        receiver.server.release("r1")
        assert tier.flush()
        assert all(disk.contains(key) for key in keys)  # written meanwhile: kept
        sizes = receiver.server.table_sizes()
        assert sizes["server_offload"] == sizes["server_admin"] == 0
    finally:
        sender.close()
        receiver.close()
        tier.close()


def test_a_full_queue_of_blocking_work_is_refused_busy_and_the_rest_served(
    tmp_path: Path, unlinks: SlowUnlinks
) -> None:
    tier, _ = tier_with_files(tmp_path)
    config = TransferConfig(transport="loopback")
    plane = open_data_plane(config, f"live-b{next(_names)}")
    pool = tier.store.pool
    plane.register_pool(pool.base_address, pool.nbytes, str(pool.device))
    admin = Offload(threads=1, max_queued=1, name="fabric-admin")
    server = TransferServer(tier.store, plane, config, FINGERPRINT, tier=tier, admin=admin)
    server.start()
    clients = [StoreClient(server.endpoint, timeout_ms=60_000) for _ in range(4)]
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda c=c: results.append(c.clear("disk")), daemon=True)
        for c in clients[:2]
    ]
    try:
        threads[0].start()
        assert unlinks.started.wait(30)  # the first runs (parked), ...
        threads[1].start()
        deadline = time.monotonic() + 30
        while server.table_sizes()["server_admin"] < 2:  # ... the second waits its turn
            assert time.monotonic() < deadline, "the second Clear never reached the queue"
            time.sleep(0.01)
        # The third finds the queue full: Refused(code="busy"), at once.
        with pytest.raises(TransferError, match="busy"):
            clients[2].clear("disk")
        stats = clients[3].stats()
        assert stats["server_admin_busy"] == 1 and stats["server_offload_busy"] == 0
        assert clients[3].lookup([1] * 32, hold="r").hit_chunks == 0  # the lookups queue: free
    finally:
        unlinks.gate.set()
        for thread in threads:
            thread.join(60)
        for client in clients:
            client.close()
        server.close()
        plane.close()
        tier.close()
    assert sorted(results) == [0, FILES]


def test_offload_hands_replies_to_the_loop_and_survives_errors() -> None:
    offload = Offload(threads=1, max_queued=1).start()
    started, gate = threading.Event(), threading.Event()

    def blocked() -> proto.Message:
        started.set()
        assert gate.wait(30)
        return proto.Done(1, 10)

    def broken() -> proto.Message:
        raise RuntimeError("injected")

    try:
        assert offload.submit(b"a", 1, blocked)
        assert started.wait(30)
        assert offload.submit(b"b", 2, broken)
        assert not offload.submit(b"c", 3, blocked) and offload.busy == 1
        gate.set()
        replies: list[tuple[bytes, proto.Message]] = []
        while len(replies) < 2:
            ready, _, _ = select.select([offload.wake_fd], [], [], 30)
            assert ready, "the loop was never woken"
            replies += offload.take_done()
        assert replies[0] == (b"a", proto.Done(1, 10))
        identity, refused = replies[1]
        assert identity == b"b" and isinstance(refused, proto.Refused)
        assert (refused.seq, refused.code) == (2, "internal_error") and "injected" in refused.reason
        assert offload.pending() == 0
    finally:
        gate.set()
        offload.close()


def test_a_reservation_nobody_releases_is_forgotten_after_its_lease() -> None:
    """A transfer nobody loads (its request ended before, or it was never
    scheduled): its lease runs out, its progress is marked expired for a
    consumer still polling, then dropped."""
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=4, quarantine_ms=10))
    config = TransferConfig(transport="loopback", poll_interval_ms=0.5)
    receiver = TransferNode(store, config, FINGERPRINT, name=f"live-r{next(_names)}")
    sender_store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=4, quarantine_ms=10))
    sender = TransferNode(
        sender_store, config, FINGERPRINT, name=f"live-s{next(_names)}", serve=False
    )
    try:
        assert receiver.server is not None
        keys, slots = fill_store(sender, 3, 2, SLOT)
        link = sender.client.connect(receiver.endpoint)
        link.push("landed", keys, slots, timeout=5, lease_ms=200)  # then nobody came
        link.reserve("empty", [chunk_key(4, 0)], [SLOT], lease_ms=200)  # nothing came
        prog = receiver.server.wait_until("empty", lambda p: p.expired, 30)
        assert prog is not None and prog.expired  # a consumer polling it sees it end
        deadline = time.monotonic() + 30
        while receiver.server.progress("landed") or receiver.server.progress("empty"):
            assert time.monotonic() < deadline, "an ended reservation was never forgotten"
            time.sleep(0.02)
        sizes = receiver.server.table_sizes()
        assert sizes["server_progress"] == sizes["server_ended"] == sizes["store_leases"] == 0
        assert sizes["store_referenced_slots"] == 0
    finally:
        sender.close()
        receiver.close()


def park_writes_behind(tier: TieredStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Stall the disk writer on its next put, so a Clear waits in its flush;
    returns the gate that lets it go on."""
    assert tier.disk is not None
    real_put, gate = tier.disk.put, threading.Event()

    def put(key: bytes, data: object, checksum: int) -> bool:
        assert gate.wait(60), "the test never opened the gate"
        return real_put(key, data, checksum)

    monkeypatch.setattr(tier.disk, "put", put)
    return gate


def test_lookups_are_answered_while_a_clear_and_a_pin_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's Clear (waiting for the disk writer) and Pin (reading
    from disk) never hold up the scheduler's Lookups: a Lookup that holds
    (reading its chunks back from disk) is answered while both still wait."""
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=32, quarantine_ms=10))
    disk = DiskTier(tmp_path / "disk", 1 << 30)
    tier = TieredStore(store, chunk_tokens=16, fingerprint=FINGERPRINT, disk=disk)
    pinned, looked_up = [7] * 16 + [8] * 16, [5] * 16 + [6] * 16  # 2 chunks each
    for key in tier.keys(pinned) + tier.keys(looked_up):
        store.commit(store.allocate(key), key, 64)
    assert tier.flush() and store.drop_unused() == 4  # on disk only
    pin_reads = ParkedReads(tier, monkeypatch, tier.keys(pinned)[0])
    writes = park_writes_behind(tier, monkeypatch)
    extra = chunk_key(77, 0)
    store.commit(store.allocate(extra), extra, 64)  # queued for the (stalled) disk writer
    config = TransferConfig(transport="loopback")
    node = TransferNode(store, config, FINGERPRINT, name=f"live-a{next(_names)}", tier=tier)
    assert node.server is not None
    admins = [StoreClient(node.endpoint, timeout_ms=60_000) for _ in range(2)]
    probe = StoreClient(node.endpoint, timeout_ms=30_000)  # NOTE: a hang guard only
    results: dict[str, object] = {}
    clear = threading.Thread(target=lambda: results.update(clear=admins[0].clear("disk")))
    pin = threading.Thread(target=lambda: results.update(pin=admins[1].pin(pinned)))
    try:
        for count, thread in enumerate((clear, pin), 1):  # NOTE: the Clear first, then the Pin
            thread.start()
            deadline = time.monotonic() + 30
            while sum(n for k, n in node.server.table_sizes().items() if k in OFFLOADS) < count:
                assert time.monotonic() < deadline, "the Clear or the Pin never reached the server"
                time.sleep(0.01)
        hit = probe.lookup(looked_up, hold="r")
        assert (hit.hit_chunks, hit.disk_chunks, hit.held) == (2, 2, True)
        assert clear.is_alive() and pin.is_alive() and not results  # both still waiting
        assert probe.release("r")
    finally:
        writes.set()
        pin_reads.gate.set()
        clear.join(60)
        pin.join(60)
        for client in (*admins, probe):
            client.close()
        node.close()
        tier.close()
    assert results == {"clear": 5, "pin": 0}  # the Pin ran after the Clear emptied the disk


OFFLOADS = ("server_offload", "server_admin")


def test_a_server_holding_nothing_ticks_twice_a_second_and_still_runs_its_leases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefiller's receiver holds nothing while its engine computes: its
    loop wakes about twice a second (each wake-up costs the engine's core
    0.1-0.3 ms), not every ``idle_poll_interval_ms`` (50 ms in an engine).
    A Reserve still wakes it at once, and the lease it makes runs out on
    time: the loop ticks at the idle interval again while it lives."""
    steps: list[float] = []
    real_step = TransferServer._step

    def step(self: TransferServer, *args: Any) -> float:
        steps.append(time.monotonic())
        return real_step(self, *args)

    monkeypatch.setattr(TransferServer, "_step", step)
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=4, quarantine_ms=10))
    config = TransferConfig(transport="loopback", idle_poll_interval_ms=50.0)
    receiver = TransferNode(store, config, FINGERPRINT, name=f"live-r{next(_names)}")
    sender = TransferNode(
        ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=4, quarantine_ms=10)),
        config,
        FINGERPRINT,
        name=f"live-s{next(_names)}",
        serve=False,
    )
    try:
        assert receiver.server is not None
        time.sleep(0.3)  # NOTE: its start-up wake-ups
        start = time.monotonic()
        time.sleep(2.0)
        quiet = [t for t in steps if start <= t < start + 2.0]
        # NOTE: 4 at EMPTY_POLL_MS (the old loop: 40); a busy machine only makes fewer
        assert len(quiet) <= 8, f"{len(quiet)} wake-ups in 2 s holding nothing"
        assert receiver.server._holds_nothing()
        link = sender.client.connect(receiver.endpoint)
        link.reserve("idle", [chunk_key(5, 0)], [SLOT], lease_ms=1500)  # nothing comes
        assert not receiver.server._holds_nothing()  # NOTE: the lease: ticks at 50 ms
        prog = receiver.server.wait_until("idle", lambda p: p.expired, 30)
        assert prog is not None and prog.expired and receiver.server.stats.expired == 1
        deadline = time.monotonic() + 30
        while not receiver.server._holds_nothing():  # NOTE: its slot's quarantine, its note
            assert time.monotonic() < deadline, "the server never held nothing again"
            time.sleep(0.02)
        assert not store.has_deadlines()
    finally:
        sender.close()
        receiver.close()
