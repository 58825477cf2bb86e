"""Pack one chunk layer group by layer group, as the forward computes them.

A chunk's bytes are layer-major (:mod:`fabric.kv.layout`): all of layer 0's
segments for the chunk's blocks, then layer 1's, and so on. So the layers
``a .. b - 1`` of a chunk are one contiguous byte range of it, and a chunk
can be packed in layer order, a group of layers at a time, while the model
computes the later layers::

    forward:   layer 0 .. 7 | layer 8 .. 15 | ... | layer 24 .. 31 | sample
    pack:                    layers 0 .. 7  | ...                  | 24 .. 31, commit

The checksum is a streaming xxh3-64 fed in chunk order, so the digest is
the one :func:`~fabric.kv.pack.pack_checksummed` gives for the whole chunk
(the store keeps it; every reader verifies against it). As there, each
piece's source is hashed right after its copy read it (copies under
``FUSED_MIN_COPY_BYTES`` on average: packed, then their bytes hashed).

CPU caches with the C copy extension only (:func:`supported`): on an
accelerator the forward is only enqueued when a layer's hook runs.

:class:`LayerwiseUnpack` is the receiving side: a chunk whose layer groups
land one after another (a prefiller writes each group as it is packed) is
unpacked into the decoder's blocks a group at a time, every byte of the
group hashed in the same pass (:func:`~fabric.kv.pack.unpack_hashing`, as a
verified :func:`~fabric.kv.pack.unpack` does the whole chunk),
so that once the last group is in, the streaming digest is the chunk's and
nothing is read twice.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import xxhash

from fabric.errors import LayoutError
from fabric.kv.direct import span_ranges
from fabric.kv.layout import KVLayout, named_layers, segment_table
from fabric.kv.pack import (
    FUSED_MIN_COPY_BYTES,
    _block_ids,
    _check_buffer,
    _unique_block_ids,
    backend,
    copy_hashing,
    copy_plan,
    copy_to_chunk,
    table_plan,
    unpack_hashing,
    unpack_rows,
    verified_span,
)

if TYPE_CHECKING:
    import torch

    from fabric.kv.layout import KVCaches, SegmentTable
    from fabric.kv.pack import BlockIds

__all__ = [
    "LayerwiseHash",
    "LayerwisePack",
    "LayerwiseUnpack",
    "group_ends",
    "layer_bytes",
    "supported",
]


def supported(kv_caches: KVCaches) -> bool:
    """Whether ``kv_caches`` can be packed layer by layer here (CPU, C backend)."""
    layers = named_layers(kv_caches)
    return bool(layers) and layers[0][1].device.type == "cpu" and backend() == "c"


def group_ends(num_layers: int, groups: int) -> list[int]:
    """The layer counts after which each of ``groups`` groups ends (the last
    is ``num_layers``); fewer groups when there are fewer layers.

    Groups shrink toward the end: each is at most about twice the next, and
    the last as small as that allows (32 layers in 8 groups: 5, 5, 5, 5, 5,
    4, 2, 1, ends ``[5, 10, 15, 20, 25, 29, 31, 32]``; in 2: 21, 11). What
    the last group holds is left to do once the forward ended: the
    prefiller packs or hashes it, the decoder reads and unpacks it, while
    the request waits. Each earlier group is handled while the forward
    computes the next, at least half its size (a CPU forward computes a
    layer far more slowly than its KV is hashed or copied); even groups
    left an eighth of the prompt's KV to the tail.
    """
    if num_layers < 1 or groups < 1:
        raise LayoutError(f"group_ends: {num_layers} layers in {groups} groups")
    if groups >= num_layers:
        return list(range(1, num_layers + 1))
    # NOTE: sizes x, 2x, 4x ... from the end hold up to x * (2**groups - 1) layers
    size = -(-num_layers // ((1 << groups) - 1))
    tail: list[int] = []
    left, count = num_layers, groups
    while count > 1 and size < left / count:
        tail.append(size)
        left, count, size = left - size, count - 1, 2 * size
    head = [left // count + (1 if g < left % count else 0) for g in range(count)]
    return list(itertools.accumulate([*head, *reversed(tail)]))


def layer_bytes(layout: KVLayout, chunk_blocks: int) -> int:
    """Bytes of one layer in a chunk of ``chunk_blocks`` blocks (layers ``a ..
    b - 1`` are its bytes ``a * n .. b * n - 1``)."""
    return layout.chunk_nbytes(chunk_blocks) // layout.num_layers


class _LayerSteps:
    """A copy plan's rows taken a layer group at a time: the plan lists every
    (layer, segment) row's runs in chunk order, the same number per row, so
    layers ``a .. b - 1`` are its rows ``a * per_layer .. b * per_layer - 1``.
    ``what`` names the user in errors."""

    def __init__(self, rows: int, num_layers: int, what: str) -> None:
        self.per_layer = rows // num_layers
        if self.per_layer * num_layers != rows:
            raise LayoutError(f"{what}: the copies do not tile the chunk by layer")
        self.num_layers = num_layers
        self.what = what
        self.done = 0

    def advance(self, upto: int) -> tuple[int, int] | None:
        """The rows of layers ``done .. upto - 1`` (now done); None when
        ``upto`` is not past them."""
        if not 0 <= upto <= self.num_layers:
            raise LayoutError(f"{self.what}: layer {upto} of {self.num_layers}")
        if upto <= self.done:
            return None
        rows = self.done * self.per_layer, upto * self.per_layer
        self.done = upto
        return rows


class LayerwisePack:
    """The pack of blocks ``block_ids`` into ``dst``, a layer group at a time.

    ``pack_layers(n)`` copies layers ``done .. n - 1`` (every one of them
    must hold its final KV for these blocks by then); ``finish()`` copies
    the rest and returns ``(nbytes, checksum)``, as ``pack_checksummed``.
    """

    def __init__(
        self, kv_caches: KVCaches, layout: KVLayout, block_ids: BlockIds, dst: torch.Tensor
    ) -> None:
        if not supported(kv_caches):
            raise LayoutError("layer-wise packing needs a CPU cache and fabric.kv._copy")
        ids = _block_ids(block_ids, layout)
        device = named_layers(kv_caches)[0][1].device
        self._nbytes = _check_buffer(dst, layout, len(ids), "dst", device)
        self._dst = dst
        offsets, cache, lengths = copy_plan(kv_caches, layout, ids, 0)
        self._offsets, self._cache, self._lengths = offsets, cache, lengths
        if lengths.sum() != self._nbytes:
            raise LayoutError("layer-wise pack: the copies do not tile the chunk")
        self._steps = _LayerSteps(len(offsets), layout.num_layers, "layer-wise pack")
        self._fused = bool(lengths.size) and lengths.mean() >= FUSED_MIN_COPY_BYTES
        self._hasher = xxhash.xxh3_64()

    @property
    def layers_done(self) -> int:
        """Layers packed so far (``0 .. num_layers``)."""
        return self._steps.done

    @property
    def bytes_done(self) -> int:
        """The chunk's leading bytes packed so far (those of ``layers_done``)."""
        return self._nbytes * self._steps.done // self._steps.num_layers

    def pack_layers(self, upto: int) -> None:
        """Pack layers ``layers_done .. upto - 1``; a no-op when ``upto`` is not past them."""
        rows = self._steps.advance(upto)
        if rows is None:
            return
        a, b = rows
        offsets, cache, lengths = self._offsets[a:b], self._cache[a:b], self._lengths[a:b]
        if not offsets.size:
            return
        base = self._dst.data_ptr()
        if self._fused:
            copy_hashing(base, offsets, cache, lengths, self._hasher)
            return
        copy_to_chunk(base, offsets, cache, lengths)
        lo, hi = int(offsets[0]), int(offsets[-1] + lengths[-1])
        self._hasher.update(self._dst[lo:hi].numpy().data)

    def finish(self) -> tuple[int, int]:
        """Pack the layers left; ``(nbytes, checksum)`` of the whole chunk."""
        self.pack_layers(self._steps.num_layers)
        return self._nbytes, self._hasher.intdigest()


class LayerwiseHash:
    """The checksum of the chunk in blocks ``block_ids`` of a CPU cache, taken
    in place a layer group at a time (a chunk offered while the forward still
    computes its later layers): ``hash_layers(n)`` adds layers ``done .. n -
    1`` (each final by then), ``finish()`` the rest and returns the digest,
    the one :func:`~fabric.kv.direct.checksum_spans` gives for the whole
    chunk (xxh3-64 fed in chunk order, which is layer-major).

    It runs on the prefiller's core during the forward, a call per layer
    group and chunk, so the chunk's ranges are worked out once, here: each
    layer's pieces, neighbours contiguous in memory merged, as offsets into
    one view of the cache's address span; a call only feeds those ranges
    to the hasher. ``table``: the cache's
    :func:`~fabric.kv.layout.segment_table`, when the caller keeps one
    (the cache tensors must be those it was taken from)."""

    def __init__(
        self,
        kv_caches: KVCaches,
        layout: KVLayout,
        block_ids: BlockIds,
        table: SegmentTable | None = None,
    ) -> None:
        self.block_ids = list(block_ids)
        # NOTE: the view below does not keep the cache alive: this does
        self._caches = kv_caches
        if table is None:
            table = segment_table(kv_caches, layout)
        elif len(table.bases) != layout.num_layers * layout.segments or int(table.bases[0]) != int(
            named_layers(kv_caches)[0][1].data_ptr()
        ):
            raise LayoutError("layer-wise hash: the segment table is not this cache's")
        _, addrs, lengths = table_plan(table, _block_ids(block_ids, layout), 0)
        self._steps = _LayerSteps(len(addrs), layout.num_layers, "layer-wise hash")
        self._view, self._starts, self._lengths, self._bounds = span_ranges(
            addrs, lengths, self._steps.per_layer, layout.num_layers
        )
        self._hasher = xxhash.xxh3_64()

    @property
    def layers_done(self) -> int:
        return self._steps.done

    def hash_layers(self, upto: int) -> None:
        """Hash layers ``layers_done .. upto - 1``; a no-op when ``upto`` is not past them."""
        first = self._steps.done
        if self._steps.advance(upto) is None:
            return
        update, view, starts, lengths = self._hasher.update, self._view, self._starts, self._lengths
        for i in range(self._bounds[first], self._bounds[upto]):
            at = starts[i]
            update(view[at : at + lengths[i]])

    def finish(self) -> int:
        """Hash the layers left; the whole chunk's checksum."""
        self.hash_layers(self._steps.num_layers)
        return self._hasher.intdigest()


class LayerwiseUnpack:
    """Unpack the chunk in ``src`` into blocks ``block_ids`` a layer group at a time.

    ``block_ids`` receive the chunk's blocks ``first ..`` (of ``chunk_blocks``),
    as :func:`~fabric.kv.pack.unpack`. ``unpack_layers(n)`` hashes the
    chunk's bytes of layers ``layers_done .. n - 1`` (also those of blocks
    not copied) and copies each piece into the blocks right after hashing
    it; ``finish()`` does the layers left and the slot's bytes past the
    chunk up to ``nbytes`` (what the sender's checksum covers), and returns
    the digest. The caller compares it: on a mismatch the blocks written
    hold garbage and must be recomputed (or the chunk unpacked anew).
    """

    def __init__(
        self,
        src: torch.Tensor,
        kv_caches: KVCaches,
        layout: KVLayout,
        block_ids: BlockIds,
        *,
        chunk_blocks: int,
        first: int,
        nbytes: int,
    ) -> None:
        if not supported(kv_caches):
            raise LayoutError("layer-wise unpacking needs a CPU cache and fabric.kv._copy")
        ids = _unique_block_ids(block_ids, layout)
        device = named_layers(kv_caches)[0][1].device
        covered, _ = verified_span(src, layout, len(ids), chunk_blocks, first, nbytes, device)
        self._plan = unpack_rows(kv_caches, layout, ids, chunk_blocks, first)
        self._rows_per_layer = len(self._plan[0]) // layout.num_layers
        self._num_layers = layout.num_layers
        self._layer_bytes = covered // layout.num_layers
        self._covered, self._nbytes = covered, nbytes
        self._src = src
        self._hasher = xxhash.xxh3_64()
        self._done = 0

    @property
    def layers_done(self) -> int:
        """Layers unpacked (and hashed) so far (``0 .. num_layers``)."""
        return self._done

    @property
    def bytes_read(self) -> int:
        """The chunk's leading bytes hashed and unpacked so far."""
        return self._done * self._layer_bytes

    def unpack_layers(self, upto: int) -> None:
        """Hash and unpack layers ``layers_done .. upto - 1``; a no-op when
        ``upto`` is not past them."""
        if not 0 <= upto <= self._num_layers:
            raise LayoutError(f"unpack_layers: layer {upto} of {self._num_layers}")
        if upto <= self._done:
            return
        a, b = self._done, upto
        self._done = upto
        rows = slice(a * self._rows_per_layer, b * self._rows_per_layer)
        span = (a * self._layer_bytes, b * self._layer_bytes)
        unpack_hashing(self._src, self._hasher, span, *(x[rows].ravel() for x in self._plan))

    def finish(self) -> int:
        """Unpack the layers left; the xxh3-64 of the source's first ``nbytes``."""
        self.unpack_layers(self._num_layers)
        if self._nbytes > self._covered:
            self._hasher.update(self._src.numpy().data[self._covered : self._nbytes])
            self._covered = self._nbytes
        return self._hasher.intdigest()
