"""Direct reads through the server: a sender offers a chunk final in its paged
cache (``PeerLink.offer``), the receiver READs it into the chunk's slot and
verifies it as a written chunk (loopback plane; the NIXL one in
``test_direct_read.py``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from fabric.errors import FabricError, ReservationRefused
from fabric.kv import KVLayout, pack
from fabric.kv.direct import CacheMap, cache_map, cache_regions, cache_spans, checksum_spans
from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode

from .direct_peer import BLOCK_IDS, cache

_names = itertools.count()


@dataclass
class Pair:
    sender: TransferNode
    receiver: TransferNode
    layers: list[torch.Tensor]
    layout: KVLayout
    nbytes: int

    @property
    def cmap(self) -> CacheMap:
        return cache_map(self.layers, self.layout)

    def checksum(self, block_ids: list[int] = BLOCK_IDS) -> int:
        spans = cache_spans(self.layers, self.layout, block_ids)
        return checksum_spans(spans.addrs, spans.lengths)

    def packed(self, block_ids: list[int] = BLOCK_IDS) -> torch.Tensor:
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        pack(self.layers, self.layout, block_ids, out)
        return out


def node(layout: KVLayout, nbytes: int, *, serve: bool) -> TransferNode:
    store = ChunkStore(StoreConfig(slot_bytes=nbytes, num_slots=4, quarantine_ms=10))
    config = TransferConfig(transport="loopback", poll_interval_ms=0.5)
    return TransferNode(
        store, config, layout.fingerprint(), name=f"offer-{next(_names)}", serve=serve
    )


@pytest.fixture
def pair() -> Iterator[Pair]:
    layers = cache(seed=3)
    layout = KVLayout.from_tensors(layers)
    nbytes = layout.chunk_nbytes(len(BLOCK_IDS))
    sender, receiver = node(layout, nbytes, serve=False), node(layout, nbytes, serve=True)
    for base, size in cache_regions(layers):
        sender.plane.register_region(base, size)
    assert receiver.server is not None
    receiver.server.enable_reads(layout)
    yield Pair(sender, receiver, layers, layout, nbytes)
    sender.close()
    receiver.close()


def test_an_offered_chunk_is_read_into_its_slot_and_verified(pair: Pair) -> None:
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t1", [b"k" * 16], [pair.nbytes])
    link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    prog = server.wait("t1", 5)
    assert prog is not None and prog.complete
    slot = pair.receiver.store.acquire([b"k" * 16])
    assert slot == [res.slots[0]]
    assert torch.equal(pair.receiver.store.pool.slot_view(slot[0]), pair.packed())
    pair.receiver.store.release_slots(slot)
    stats = server.stats
    assert (stats.chunks_read, stats.bytes_read, stats.chunks_filled) == (1, pair.nbytes, 1)


def test_a_source_changed_after_its_checksum_fails_the_chunk(pair: Pair) -> None:
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t2", [b"k" * 16], [pair.nbytes])
    checksum = pair.checksum()
    pair.layers[2][0, BLOCK_IDS[3], 0, 0, 0] += 1  # NOTE: the blocks were reused meanwhile
    link.offer(res, 0, BLOCK_IDS, checksum, pair.cmap)
    prog = server.wait("t2", 5)
    assert prog is not None and prog.failed == {0} and not prog.filled
    assert not pair.receiver.store.contains(b"k" * 16)
    assert server.stats.checksum_failures == 1


def test_offers_that_cannot_be_read_are_refused_and_counted(pair: Pair) -> None:
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t3", [b"a" * 16, b"b" * 16], [pair.nbytes, pair.nbytes])
    good = pair.checksum()
    with pytest.raises(ReservationRefused, match="outside"):
        link.offer(res, 0, [*BLOCK_IDS[:-1], 32], good, pair.cmap)  # NOTE: 32 blocks
    short = pair.layout.chunk_nbytes(len(BLOCK_IDS) - 1)
    with pytest.raises(ReservationRefused, match=f"{short} bytes"):
        link.offer(res, 0, BLOCK_IDS[:-1], good, pair.cmap)
    other = CacheMap(*[getattr(pair.cmap, f) for f in ("bases", "block_strides")], 1, 32, "x")
    with pytest.raises(ReservationRefused, match="does not fit"):
        link.offer(res, 0, BLOCK_IDS, good, other)
    stale = type(res)(
        res.request_id, res.keys, res.nbytes, res.slots, (99, 99), res.already_present
    )
    with pytest.raises(ReservationRefused, match="generation"):
        link.offer(stale, 0, BLOCK_IDS, good, pair.cmap)
    link.offer(res, 0, BLOCK_IDS, good, pair.cmap)
    with pytest.raises(ReservationRefused, match="waits to be read"):
        link.offer(res, 0, BLOCK_IDS, good, pair.cmap)  # NOTE: read already
    link.offer(res, 1, BLOCK_IDS, good, pair.cmap)
    prog = server.wait("t3", 5)
    assert prog is not None and prog.complete
    assert server.stats.offers_refused == 5


def test_a_read_outside_the_senders_registered_memory_is_refused(pair: Pair) -> None:
    """A cache map pointing past what the sender registered is never read."""
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t4", [b"k" * 16], [pair.nbytes])
    far = pair.cmap
    moved = CacheMap(
        [b + (1 << 30) for b in far.bases],
        far.block_strides,
        far.segment_bytes,
        far.num_blocks,
        far.fingerprint,
    )
    with pytest.raises(ReservationRefused, match="read_failed"):
        link.offer(res, 0, BLOCK_IDS, pair.checksum(), moved)
    prog = server.wait("t4", 5)
    assert prog is not None and prog.failed == {0}
    assert server.stats.read_failures == 1


def test_a_receiver_that_does_not_read_refuses_offers(pair: Pair) -> None:
    layout = pair.layout
    plain = node(layout, pair.nbytes, serve=True)
    try:
        link = pair.sender.client.connect(plain.endpoint)
        res = link.reserve("t5", [b"k" * 16], [pair.nbytes])
        with pytest.raises(ReservationRefused, match="does not read"):
            link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    finally:
        plain.close()


def test_a_plane_that_cannot_read_is_not_enabled() -> None:
    layers = cache(seed=4)
    layout = KVLayout.from_tensors(layers)
    store = ChunkStore(StoreConfig(slot_bytes=4096, num_slots=2))
    tcp = TransferNode(store, TransferConfig(transport="tcp"), layout.fingerprint())
    try:
        assert tcp.server is not None
        with pytest.raises(FabricError, match="cannot read"):
            tcp.server.enable_reads(layout)
    finally:
        tcp.close()
