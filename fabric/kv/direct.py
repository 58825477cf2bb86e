"""The direct path's plan: a chunk moved from one paged cache into another,
block to block, with no chunk buffer on either side.

:func:`fabric.kv.pack.pack` copies each (layer, segment, run of blocks)
piece of a cache to its offset in the chunk (the format drawn in
:mod:`fabric.kv.layout`). Two caches of the same layout, each with its own
block ids for the chunk, have pieces at the same chunk offsets; cut where
either side's pieces end, they pair up::

    chunk offsets  0 ........ a ......... b ............ c ........ n
    source         | P run 0            | P run 1                 |
    destination    | D run 0  | D run 1                  | D run 2  |
    pairs          |  0..a    |  a..b   |  b..c          |  c..n    |

Each pair is (source address, destination address, nbytes); neighbours
contiguous on both sides merge into one. The pairs in chunk-offset order
cover the chunk exactly once, so:

- one transfer descriptor per pair moves the chunk (what NIXL posts);
- the xxh3-64 of the source bytes taken in that order is the checksum of
  the packed chunk (:func:`checksum_spans`), the checksum the store keeps
  for it: the destination hashes its own bytes in the same order after the
  copy and compares, so the direct path is verified like the staged one;
- the chunk format is layer-major, so a layer group is the pairs whose
  offsets lie in one byte range (:meth:`DirectPlan.layers`), moved and
  checked on its own.

CPU memory only for the checksums (addresses are read in place).
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import xxhash

from fabric.errors import LayoutError
from fabric.kv.layout import KVLayout, SegmentTable, segment_table
from fabric.kv.pack import _block_ids, copy_plan, table_plan

if TYPE_CHECKING:
    from fabric.kv.layout import KVCaches
    from fabric.kv.pack import BlockIds

__all__ = [
    "CacheMap",
    "DirectPlan",
    "Spans",
    "cache_map",
    "cache_regions",
    "cache_spans",
    "checksum_spans",
    "direct_plan",
    "map_spans",
    "span_ranges",
]


@dataclass(frozen=True)
class Spans:
    """A chunk's pieces in one cache, ascending by chunk offset, tiling
    ``0 .. nbytes``: piece ``i`` is ``lengths[i]`` bytes at ``addrs[i]``."""

    offsets: np.ndarray
    addrs: np.ndarray
    lengths: np.ndarray
    nbytes: int


@dataclass(frozen=True)
class DirectPlan:
    """Paired pieces of one chunk (see the module docstring), ascending by
    chunk offset: ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]``."""

    offsets: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    nbytes: int

    def __len__(self) -> int:
        return len(self.offsets)

    def between(self, lo: int, hi: int) -> DirectPlan:
        """The pairs covering chunk bytes ``lo .. hi - 1``, cut at both ends."""
        if not 0 <= lo <= hi <= self.nbytes:
            raise ValueError(f"range {lo}..{hi} is outside the chunk's {self.nbytes} bytes")
        ends = self.offsets + self.lengths
        keep = (ends > lo) & (self.offsets < hi) & (lo < hi)
        off, ln = self.offsets[keep], self.lengths[keep]
        start = np.maximum(off, lo)
        skip = start - off
        length = np.minimum(off + ln, hi) - start
        return DirectPlan(start, self.src[keep] + skip, self.dst[keep] + skip, length, self.nbytes)

    def layers(self, layout: KVLayout, num_blocks: int, first: int, stop: int) -> DirectPlan:
        """The pairs of layers ``first .. stop - 1`` of a ``num_blocks`` chunk."""
        if not 0 <= first <= stop <= layout.num_layers:
            raise ValueError(f"layers {first}..{stop} of {layout.num_layers}")
        per_layer = layout.segments * num_blocks * layout.segment_bytes
        if per_layer * layout.num_layers != self.nbytes:
            raise ValueError(f"a {num_blocks}-block chunk is not this plan's {self.nbytes} bytes")
        return self.between(first * per_layer, stop * per_layer)

    def read_rows(self) -> np.ndarray:
        """Nx3 (destination, source, nbytes) rows: what the destination's
        :meth:`~fabric.transfer.dataplane.DataPlane.post_read` takes."""
        return np.stack([self.dst, self.src, self.lengths], axis=1)


def cache_spans(kv_caches: KVCaches, layout: KVLayout, block_ids: BlockIds) -> Spans:
    """Where the chunk of ``block_ids`` lies in ``kv_caches`` (CPU or device
    addresses; the layout is checked as for a pack)."""
    ids = _block_ids(block_ids, layout)
    # NOTE: a copy plan is in chunk order already (row by row, runs ascending)
    return Spans(*copy_plan(kv_caches, layout, ids, 0), layout.chunk_nbytes(len(ids)))


class CacheMap(msgspec.Struct, array_like=True, frozen=True):
    """Where a cache's blocks are, for a peer that reads them: row ``p`` (layer
    ``p // segments``, segment ``p % segments``) of block ``b`` is
    ``segment_bytes`` at ``bases[p] + b * block_strides[p]``, for
    ``0 <= b < num_blocks``. Sent with each offered chunk; the reader computes
    the chunk's addresses itself (:func:`map_spans`)."""

    bases: list[int]
    block_strides: list[int]
    segment_bytes: int
    num_blocks: int
    fingerprint: str
    """The cache's :meth:`~fabric.kv.layout.KVLayout.fingerprint`: dtype, heads,
    block size, kind, TP rank..., which equal byte sizes do not show."""


def cache_map(kv_caches: KVCaches, layout: KVLayout) -> CacheMap:
    """This cache's :class:`CacheMap` (the layout checked as for a pack)."""
    table = segment_table(kv_caches, layout)
    return CacheMap(
        table.bases.tolist(),
        table.block_strides.tolist(),
        table.segment_bytes,
        layout.num_blocks,
        layout.fingerprint(),
    )


def map_spans(cmap: CacheMap, layout: KVLayout, block_ids: BlockIds) -> Spans:
    """:func:`cache_spans` of a peer's cache described by ``cmap``; refuses a
    map that does not fit ``layout`` and block ids outside it."""
    rows = layout.num_layers * layout.segments
    if (
        cmap.fingerprint != layout.fingerprint()
        or len(cmap.bases) != rows
        or len(cmap.block_strides) != rows
        or cmap.segment_bytes != layout.segment_bytes
        or cmap.num_blocks <= 0
        or min(cmap.block_strides, default=0) < cmap.segment_bytes
    ):
        raise LayoutError("the peer's cache map does not fit this layout")
    try:
        ids = _block_ids(block_ids, dataclasses.replace(layout, num_blocks=cmap.num_blocks))
    except LayoutError as exc:
        raise LayoutError(f"block ids outside the peer's cache: {exc}") from exc
    try:
        table = SegmentTable(
            np.asarray(cmap.bases, dtype=np.int64),
            np.asarray(cmap.block_strides, dtype=np.int64),
            cmap.segment_bytes,
        )
    except OverflowError as exc:
        raise LayoutError(f"the peer's cache map has addresses out of range: {exc}") from exc
    if (table.bases < 0).any():
        raise LayoutError("the peer's cache map has negative addresses")
    return Spans(*table_plan(table, ids, 0), layout.chunk_nbytes(len(ids)))


def direct_plan(src: Spans, dst: Spans) -> DirectPlan:
    """Pair two caches' pieces of one chunk (see the module docstring)."""
    _check_tiles(src)
    _check_tiles(dst)
    if src.nbytes != dst.nbytes:
        raise LayoutError(
            f"the source chunk has {src.nbytes} bytes and the destination {dst.nbytes}"
        )
    if src.nbytes == 0:
        empty = np.zeros(0, dtype=np.int64)
        return DirectPlan(empty, empty, empty, empty, 0)
    cuts = np.union1d(src.offsets, dst.offsets)
    lengths = np.diff(cuts, append=src.nbytes)
    si = np.searchsorted(src.offsets, cuts, side="right") - 1
    di = np.searchsorted(dst.offsets, cuts, side="right") - 1
    s = src.addrs[si] + (cuts - src.offsets[si])
    d = dst.addrs[di] + (cuts - dst.offsets[di])
    # NOTE: merge a pair into the one before it when both sides continue it
    cont = np.zeros(len(cuts), dtype=bool)
    cont[1:] = (s[:-1] + lengths[:-1] == s[1:]) & (d[:-1] + lengths[:-1] == d[1:])
    heads = np.flatnonzero(~cont)
    merged = np.add.reduceat(lengths, heads)
    return DirectPlan(cuts[heads], s[heads], d[heads], merged, src.nbytes)


def checksum_spans(
    addrs: np.ndarray, lengths: np.ndarray, hasher: xxhash.xxh3_64 | None = None
) -> int:
    """The xxh3-64 of the bytes at ``addrs`` (CPU memory), in order.

    With ``hasher`` the bytes are added to it (a chunk hashed a layer group
    at a time) and its digest so far is returned. Neighbours contiguous in
    memory are hashed as one range (:func:`span_ranges`).
    """
    h = hasher if hasher is not None else xxhash.xxh3_64()
    addrs = np.asarray(addrs, dtype=np.int64)
    view, starts, merged, _ = span_ranges(
        addrs, np.asarray(lengths, dtype=np.int64), max(1, len(addrs)), 1
    )
    for at, n in zip(starts, merged, strict=True):
        h.update(view[at : at + n])
    return h.intdigest()


def span_ranges(
    addrs: np.ndarray, lengths: np.ndarray, per_layer: int, num_layers: int
) -> tuple[memoryview, list[int], list[int], list[int]]:
    """Pieces of CPU memory at ``addrs`` (in order, ``per_layer`` per layer)
    as ranges of one view over their extent: ``(view, starts, lengths,
    bounds)``, layer ``l``'s ranges being ``bounds[l] .. bounds[l + 1] -
    1``; neighbours contiguous in memory are merged, never across a
    layer's end. No memory is touched but the pieces' when the ranges are
    read: per range, the hasher call is most of the cost beyond the bytes."""
    if not len(addrs):
        return memoryview(b""), [], [], [0] * (num_layers + 1)
    lo = int(addrs.min())
    view = memoryview((ctypes.c_char * int((addrs + lengths).max() - lo)).from_address(lo))
    rel = addrs - lo
    head = np.ones(len(rel), dtype=bool)
    head[1:] = rel[1:] != rel[:-1] + lengths[:-1]
    head[::per_layer] = True
    heads = np.flatnonzero(head)
    bounds = np.searchsorted(heads // per_layer, np.arange(num_layers + 1))
    return (
        view.cast("B"),
        rel[heads].tolist(),
        np.add.reduceat(lengths, heads).tolist(),
        bounds.tolist(),
    )


def cache_regions(kv_caches: KVCaches) -> list[tuple[int, int]]:
    """The memory the cache tensors live in, as (base, nbytes) ranges to
    register for direct transfers: each tensor's storage, overlapping or
    touching ones merged (layers that share one allocation are one range)."""
    from fabric.kv.layout import named_layers

    ranges = sorted(
        (
            t.untyped_storage().data_ptr(),
            t.untyped_storage().data_ptr() + t.untyped_storage().nbytes(),
        )
        for _, t in named_layers(kv_caches)
    )
    merged: list[list[int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


def _check_tiles(spans: Spans) -> None:
    """The pieces cover ``0 .. nbytes`` exactly once (a plan relies on it)."""
    ends = spans.offsets + spans.lengths
    if not len(spans.offsets):
        ok = spans.nbytes == 0
    else:
        ok = bool(
            spans.offsets[0] == 0
            and ends[-1] == spans.nbytes
            and np.all(spans.offsets[1:] == ends[:-1])
            and np.all(spans.lengths > 0)
        )
    if not ok:
        raise LayoutError("the chunk's pieces do not tile it (a layout this plan cannot pair)")
