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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

from fabric.errors import LayoutError
from fabric.kv.layout import KVLayout, named_layers
from fabric.kv.pack import (
    FUSED_MIN_COPY_BYTES,
    _block_ids,
    _check_buffer,
    backend,
    copy_hashing,
    copy_plan,
    copy_to_chunk,
)

if TYPE_CHECKING:
    import torch

    from fabric.kv.layout import KVCaches
    from fabric.kv.pack import BlockIds

__all__ = ["LayerwisePack", "group_ends", "supported"]


def supported(kv_caches: KVCaches) -> bool:
    """Whether ``kv_caches`` can be packed layer by layer here (CPU, C backend)."""
    layers = named_layers(kv_caches)
    return bool(layers) and layers[0][1].device.type == "cpu" and backend() == "c"


def group_ends(num_layers: int, groups: int) -> list[int]:
    """The layer counts after which each of ``groups`` near-equal groups ends
    (the last is ``num_layers``); fewer groups when there are fewer layers."""
    if num_layers < 1 or groups < 1:
        raise LayoutError(f"group_ends: {num_layers} layers in {groups} groups")
    groups = min(groups, num_layers)
    return sorted({-(-num_layers * (g + 1) // groups) for g in range(groups)})


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
        # NOTE: copy_plan lists every (layer, segment) row's runs in chunk
        # order, the same number of runs per row
        self._per_layer = len(offsets) // layout.num_layers
        if self._per_layer * layout.num_layers != len(offsets) or lengths.sum() != self._nbytes:
            raise LayoutError("layer-wise pack: the copies do not tile the chunk by layer")
        self._num_layers = layout.num_layers
        self._fused = bool(lengths.size) and lengths.mean() >= FUSED_MIN_COPY_BYTES
        self._hasher = xxhash.xxh3_64()
        self._done = 0

    @property
    def layers_done(self) -> int:
        """Layers packed so far (``0 .. num_layers``)."""
        return self._done

    def pack_layers(self, upto: int) -> None:
        """Pack layers ``layers_done .. upto - 1``; a no-op when ``upto`` is not past them."""
        if not 0 <= upto <= self._num_layers:
            raise LayoutError(f"pack_layers: layer {upto} of {self._num_layers}")
        if upto <= self._done:
            return
        a, b = self._done * self._per_layer, upto * self._per_layer
        self._done = upto
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
        self.pack_layers(self._num_layers)
        return self._nbytes, self._hasher.intdigest()
