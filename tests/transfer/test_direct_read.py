"""Direct reads over real NIXL/UCX: a decoder reads a chunk's blocks out of a
prefiller's cache (another OS process) into its own cache, and verifies them.

Every test runs twice: reading the prefiller in place (same host,
:mod:`fabric.transfer.local_read`) and through UCX (``local_reads`` off)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from fabric.errors import PeerDisconnected, TransportFailed
from fabric.kv import KVLayout, pack, unpack
from fabric.kv.direct import (
    DirectPlan,
    Spans,
    cache_regions,
    cache_spans,
    checksum_spans,
    direct_plan,
)
from fabric.transfer.dataplane import XferState
from fabric.transfer.nixl_plane import NixlDataPlane, NixlRegions, nixl_available

sys.path.insert(0, str(Path(__file__).parent))
from direct_peer import BLOCK_IDS, cache

pytestmark = pytest.mark.skipif(not nixl_available(), reason="no nixl")

DST_IDS = [1, 2, 6, 7, 8, 25, 26, 27]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ALWAYS = THP.exists() and "[always]" in THP.read_text()
PEER = Path(__file__).parent / "direct_peer.py"


class Peer:
    def __init__(self, seed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello = self.read()

    def read(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"direct peer exited with {self.proc.poll()}"
        return dict(json.loads(line))

    def ask(self, cmd: str) -> dict[str, object]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def spans(self) -> Spans:
        h = self.hello
        arrays = [np.asarray(h[k], dtype=np.int64) for k in ("offsets", "addrs", "lengths")]
        return Spans(*arrays, nbytes=int(h["nbytes"]))  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer(seed=5)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(params=[True, False], ids=["in-place", "ucx"])
def plane(request: pytest.FixtureRequest) -> Iterator[NixlDataPlane]:
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    p = NixlDataPlane("direct-reader", ucx_net_devices="lo", local_reads=request.param)
    p.register_pool(pool.data_ptr(), pool.numel())
    try:
        yield p
    finally:
        p.close()
    # NOTE: each path is the one under test: in place only when asked for,
    # then out of the prefiller's shared cache
    if not request.node.get_closest_marker("no_read"):
        counters = p.counters()
        assert bool(counters["local_reads"] + counters["local_read_failures"]) is request.param
        # NOTE: a cache in transparent huge pages is not shared (THP "always")
        assert bool(counters["mapped_bytes"]) is (request.param and not THP_ALWAYS)


def test_a_read_in_place_sends_its_notification_after_the_bytes(
    peer: Peer, plane: NixlDataPlane
) -> None:
    _dst, name, plan = reader(peer, plane)
    assert finish(plane.post_read(name, plan.read_rows(), b"read-done")) is XferState.DONE
    assert checksum_spans(plan.dst, plan.lengths) == peer.hello["checksum"]
    deadline = time.monotonic() + 10
    while "read-done" not in peer.ask("notifs")["notifs"]:  # type: ignore[operator]
        assert time.monotonic() < deadline, "the read's notification never came"
        time.sleep(0.01)


def reader(
    peer: Peer, plane: NixlDataPlane, *, register: bool = True, regions: bool = True
) -> tuple[list[torch.Tensor], str, DirectPlan]:
    """The reader's cache (registered unless told not), the peer's name (its
    regions loaded unless told not), the plan."""
    dst = [torch.zeros_like(t) for t in cache(0)]
    if register:
        for base, nbytes in cache_regions(dst):
            plane.register_region(base, nbytes)
    name = plane.add_peer(bytes.fromhex(str(peer.hello["descriptor"])))
    # NOTE: as the prefiller's Hello learns it; its Offers then carry these regions
    peer.hello["regions"] = peer.ask(f"peer {plane.descriptor().hex()}")["regions"]
    if regions:
        plane.add_regions(name, bytes.fromhex(str(peer.hello["regions"])))
    plan = direct_plan(peer.spans(), cache_spans(dst, KVLayout.from_tensors(dst), DST_IDS))
    return dst, name, plan


def finish(handle: object, timeout: float = 20.0) -> XferState:
    deadline = time.monotonic() + timeout
    while (state := handle.poll()) is XferState.PROC:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the read neither ended nor failed"
        time.sleep(1e-3)
    handle.release()  # type: ignore[attr-defined]
    return state


def test_read_lands_the_prefillers_blocks_and_verifies(peer: Peer, plane: NixlDataPlane) -> None:
    dst, name, plan = reader(peer, plane)

    assert finish(plane.post_read(name, plan.read_rows())) is XferState.DONE
    assert checksum_spans(plan.dst, plan.lengths) == peer.hello["checksum"]
    src = cache(5)  # NOTE: the peer's bytes, regenerated from its seed
    layout = KVLayout.from_tensors(src)
    chunk = torch.empty(layout.chunk_nbytes(len(BLOCK_IDS)), dtype=torch.uint8)
    pack(src, layout, BLOCK_IDS, chunk)
    want = [torch.zeros_like(t) for t in src]
    unpack(chunk, want, layout, DST_IDS)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(dst, want, strict=True)
    )


def test_a_source_changed_after_hashing_fails_verification(
    peer: Peer, plane: NixlDataPlane
) -> None:
    _dst, name, plan = reader(peer, plane)
    hashed = peer.hello["checksum"]
    changed = peer.ask("flip")["checksum"]  # NOTE: e.g. a block reused before the read
    assert finish(plane.post_read(name, plan.read_rows())) is XferState.DONE
    got = checksum_spans(plan.dst, plan.lengths)
    assert got == changed != hashed


@pytest.mark.no_read
def test_reads_outside_registered_memory_are_refused(peer: Peer, plane: NixlDataPlane) -> None:
    dst, name, plan = reader(peer, plane, register=False)
    with pytest.raises(TransportFailed, match="this process's registered memory"):
        plane.post_read(name, plan.read_rows())  # NOTE: the local cache is not registered
    for base, nbytes in cache_regions(dst):
        plane.register_region(base, nbytes)
    beyond = plan.read_rows().copy()
    beyond[-1, 1] += 1 << 30
    with pytest.raises(TransportFailed, match="outside what"):
        plane.post_read(name, beyond)
    with pytest.raises(PeerDisconnected):
        plane.post_read("nobody", plan.read_rows())
    with pytest.raises(TransportFailed, match="overlaps"):
        plane.register_region(*cache_regions(dst)[0])


def test_the_descriptor_every_hello_carries_opens_no_cache(
    peer: Peer, plane: NixlDataPlane
) -> None:
    """A peer that loaded only the prefiller's descriptor (what its Hello
    carries, to whoever it connects to, before it checked the answer) cannot
    READ its cache: the descriptor names no region, and NIXL itself, asked
    past fabric's checks, has no registration to read it with. The region
    descriptor (sent in Offers, after the Hello was answered) opens it."""
    _dst, name, plan = reader(peer, plane, regions=False)
    with pytest.raises(TransportFailed, match="outside what"):
        plane.post_read(name, plan.read_rows())
    rows = plan.read_rows()
    local = np.stack([rows[:, 0], rows[:, 2], np.zeros(len(rows), dtype=np.int64)], axis=1)
    remote = np.stack([rows[:, 1], rows[:, 2], np.zeros(len(rows), dtype=np.int64)], axis=1)
    with plane.lock, pytest.raises(Exception, match="NOT_FOUND"):
        plane.agent.initialize_xfer(
            "READ",
            plane.agent.get_xfer_descs(local.astype(np.uint64), "DRAM"),
            plane.agent.get_xfer_descs(remote.astype(np.uint64), "DRAM"),
            name,
            b"",
        )
    with pytest.raises(TransportFailed, match="bad NIXL region descriptor"):
        plane.add_regions(name, b"\x93junk")
    plane.add_regions(name, bytes.fromhex(str(peer.hello["regions"])))
    assert finish(plane.post_read(name, plan.read_rows())) is XferState.DONE
    assert checksum_spans(plan.dst, plan.lengths) == peer.hello["checksum"]


def test_a_dead_prefiller_ends_the_read_with_an_error(peer: Peer, plane: NixlDataPlane) -> None:
    _dst, name, plan = reader(peer, plane)
    assert finish(plane.post_read(name, plan.read_rows())) is XferState.DONE  # NOTE: connected
    peer.stop()
    try:
        state = finish(plane.post_read(name, plan.read_rows()))
    except TransportFailed as exc:  # NOTE: refused at post: as good as an error
        assert "outside" not in str(exc) and "registered memory" not in str(exc)
        return
    assert state is XferState.ERR


def test_a_plane_without_a_pool_describes_itself_and_no_region() -> None:
    a, b = NixlDataPlane("no-pool-a", ucx_net_devices="lo"), NixlDataPlane("no-pool-b")
    try:
        assert b.add_peer(a.descriptor()) == "no-pool-a"
        with pytest.raises(TransportFailed, match="pool before"):
            a.register_region(0x1000, 4096)
        b.add_regions("no-pool-a", a.region_descriptor())  # NOTE: nothing to open
    finally:
        a.close()
        b.close()


@pytest.mark.no_read
def test_claims_beyond_what_the_prefiller_let_read_are_never_read_in_place(
    peer: Peer, plane: NixlDataPlane
) -> None:
    """Region claims come over the control channel; what a same-host
    reader copies in place is bounded by what the prefiller itself said
    over its link (its pool and registered regions). A claim of other
    memory of the prefiller (its registrations and token replayed, the
    ranges moved) is not read in place: NIXL, whose keys do not cover it,
    refuses or fails it."""
    _dst, name, plan = reader(peer, plane, regions=False)
    real = msgspec.msgpack.decode(bytes.fromhex(str(peer.hello["regions"])), type=NixlRegions)
    moved = [(b - (1 << 30), n) for b, n in real.regions]  # NOTE: outside its registrations
    plane.add_regions(name, msgspec.msgpack.encode(msgspec.structs.replace(real, regions=moved)))
    rows = plan.read_rows().copy()
    rows[:, 1] -= 1 << 30
    before = plane.counters()
    try:
        state = finish(plane.post_read(name, rows))
    except TransportFailed:
        state = XferState.ERR
    assert state is XferState.ERR
    after = plane.counters()
    assert after["local_reads"] + after["local_read_failures"] == (
        before["local_reads"] + before["local_read_failures"]
    )
