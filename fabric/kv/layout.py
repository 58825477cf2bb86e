"""Describe an engine's paged KV cache and the byte format of a chunk.

A :class:`KVLayout` is detected from the per-layer tensors vLLM registers
(``register_kv_caches``) and says where one block's bytes live in each layer:

    CPU    [num_blocks, num_kv_heads, block_size, 2*head_dim]   1 segment
    FLASH  [2, num_blocks, block_size, num_kv_heads, head_dim]  2 segments (K, V)
    MLA    [num_blocks, block_size, latent_dim]                 1 segment

A *segment* is the contiguous run of ``segment_bytes`` bytes that holds one
block of one layer (for FLASH: the K half or the V half of it).

Chunk byte format
-----------------

A chunk covers ``n`` blocks (``n <= chunk_blocks``; the last chunk of a prompt
may hold fewer). Its bytes are layer-major, then segment, then block::

    offset(l, s, j) = ((l * segments + s) * n + j) * segment_bytes

    FLASH, n = 3 blocks (b0 b1 b2), segments = 2 (K, V):

    |<------------- layer 0 ------------->|<------------- layer 1 ------------->|
    | K b0 | K b1 | K b2 | V b0 | V b1 | V b2 | K b0 | K b1 | K b2 | V b0 | ...
    ^ 0    ^ 1*seg                      ^ 6*seg

    total = n * block_bytes = n * num_layers * segments * segment_bytes

One layer's part is one contiguous run (so a layer can be sent as soon as it
is computed), and a partial chunk fills a contiguous prefix of a store slot.

The :meth:`KVLayout.fingerprint` covers everything two engines must agree on
before chunk bytes can be exchanged; ``num_blocks`` is left out because the
prefiller's and decoder's pools differ in size.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from fabric.errors import LayoutError, LayoutMismatch

if TYPE_CHECKING:
    import torch

    KVCaches = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]

# NOTE: bump when the chunk byte format changes; it is part of the fingerprint
# so engines running different formats refuse each other at handshake.
CHUNK_FORMAT_VERSION = 1

# Fields that must match between two engines, in the order mismatches are named.
FINGERPRINT_FIELDS = (
    "kind",
    "num_layers",
    "block_size",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "model",
    "tp_rank",
    "tp_size",
)


class LayoutKind(enum.Enum):
    """Which attention backend's paged-cache shape a layout follows."""

    CPU = "cpu"
    FLASH = "flash"
    MLA = "mla"


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one engine's paged KV cache (one TP rank).

    ``head_dim`` is the latent dimension for MLA (with ``num_kv_heads == 1``).
    ``dtype`` is the torch dtype name without the ``torch.`` prefix.
    """

    kind: LayoutKind
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_size: int
    model: str = ""
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"KVLayout.{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim <= 0 or self.element_size <= 0:
            raise LayoutError("KVLayout.head_dim and element_size must be > 0")
        if self.kind is LayoutKind.MLA and self.num_kv_heads != 1:
            raise LayoutError(f"MLA layout needs num_kv_heads == 1, got {self.num_kv_heads}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")

    @property
    def segments(self) -> int:
        """Contiguous segments per block per layer: 2 for FLASH (K, V), else 1."""
        return 2 if self.kind is LayoutKind.FLASH else 1

    @property
    def segment_bytes(self) -> int:
        """Bytes of one block of one layer in one segment."""
        per_token = self.num_kv_heads * self.head_dim * self.element_size
        if self.kind is LayoutKind.CPU:
            per_token *= 2  # K and V side by side in the last dimension
        return self.block_size * per_token

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers and segments."""
        return self.num_layers * self.segments * self.segment_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies over all layers."""
        return self.block_bytes // self.block_size

    def chunk_nbytes(self, num_blocks: int) -> int:
        """Bytes of a chunk covering ``num_blocks`` blocks."""
        return num_blocks * self.block_bytes

    def fingerprint_fields(self) -> dict[str, Any]:
        """The values covered by :meth:`fingerprint`, in canonical form."""
        fields: dict[str, Any] = {f: getattr(self, f) for f in FINGERPRINT_FIELDS}
        fields["kind"] = self.kind.value
        return fields

    def fingerprint(self) -> str:
        """Hex blake3 of everything two engines must agree on (not num_blocks)."""
        doc = {"format": CHUNK_FORMAT_VERSION, **self.fingerprint_fields()}
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return blake3.blake3(text.encode("utf-8")).hexdigest()

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`LayoutMismatch` naming the first field that differs."""
        mine, theirs = self.fingerprint_fields(), other.fingerprint_fields()
        for name in FINGERPRINT_FIELDS:
            if mine[name] != theirs[name]:
                raise LayoutMismatch(
                    f"KV layouts differ in {name}: local {mine[name]!r}, peer {theirs[name]!r}"
                )

    @classmethod
    def from_tensors(
        cls,
        kv_caches: KVCaches,
        *,
        model: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        kind: LayoutKind | str | None = None,
    ) -> KVLayout:
        """Detect the layout of ``kv_caches`` (layer name -> tensor, or a list).

        The kind is taken from the rank of the tensors unless given: 5-D with
        ``shape[0] == 2`` is FLASH, 4-D is CPU, 3-D is MLA. All layers must
        share shape, dtype and device, and every segment must be contiguous.
        """
        layers = named_layers(kv_caches)
        first_name, first = layers[0]
        kind = _detect_kind(first_name, tuple(first.shape)) if kind is None else LayoutKind(kind)
        for name, tensor in layers[1:]:
            _check_same(first_name, first, name, tensor)
        num_blocks, block_size, heads, head_dim = _geometry(kind, first_name, tuple(first.shape))
        layout = cls(
            kind=kind,
            num_layers=len(layers),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=str(first.dtype).removeprefix("torch."),
            element_size=first.element_size(),
            model=model,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        for name, tensor in layers:
            _check_segments(layout, name, tensor)
        return layout


@dataclass(frozen=True)
class SegmentTable:
    """Where each (layer, segment) lives in memory, for building copy lists.

    Row ``p = layer * segments + segment``: block ``b`` of that segment starts
    at byte address ``bases[p] + b * block_strides[p]``.
    """

    bases: np.ndarray  # int64 [num_layers * segments]
    block_strides: np.ndarray  # int64 [num_layers * segments], bytes
    segment_bytes: int

    @property
    def blocks_adjacent(self) -> bool:
        """True when consecutive blocks are back to back in every segment."""
        return bool(np.all(self.block_strides == self.segment_bytes))


def segment_table(kv_caches: KVCaches, layout: KVLayout) -> SegmentTable:
    """Compute segment base addresses and block strides of ``kv_caches``.

    Validates the tensors against ``layout`` first, so the addresses are only
    ever derived from tensors whose every block segment lies inside them.
    """
    layers = named_layers(kv_caches)
    if len(layers) != layout.num_layers:
        raise LayoutError(f"expected {layout.num_layers} layers, got {len(layers)}")
    first_name, first = layers[0]
    _check_segments(layout, first_name, first)
    ref = _signature(first)
    block_dim = 1 if layout.kind is LayoutKind.FLASH else 0
    ptrs, kv_strides, block_strides = [], [], []
    for name, tensor in layers:
        # NOTE: this runs on every pack; a layer laid out exactly like layer 0
        # (the usual case) needs no check of its own beyond that comparison.
        if _signature(tensor) != ref:
            _check_same(first_name, first, name, tensor, ("dtype", "device"))
            _check_segments(layout, name, tensor)
        ptrs.append(tensor.data_ptr())
        kv_strides.append(tensor.stride(0))
        block_strides.append(tensor.stride(block_dim))
    es = layout.element_size
    offsets = np.arange(layout.segments, dtype=np.int64)  # K, V for FLASH
    bases = np.asarray(ptrs, dtype=np.int64)[:, None] + np.outer(kv_strides, offsets) * es
    return SegmentTable(
        bases=bases.ravel(),
        block_strides=np.repeat(np.asarray(block_strides, dtype=np.int64) * es, layout.segments),
        segment_bytes=layout.segment_bytes,
    )


def _signature(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device)


def named_layers(kv_caches: KVCaches) -> list[tuple[str, torch.Tensor]]:
    """``kv_caches`` as an ordered list of (layer name, tensor)."""
    if isinstance(kv_caches, Mapping):
        layers = list(kv_caches.items())
    else:
        layers = [(f"layer[{i}]", t) for i, t in enumerate(kv_caches)]
    if not layers:
        raise LayoutError("no KV cache tensors given")
    return layers


def _detect_kind(name: str, shape: tuple[int, ...]) -> LayoutKind:
    if len(shape) == 5 and shape[0] == 2:
        return LayoutKind.FLASH
    if len(shape) == 4:
        return LayoutKind.CPU
    if len(shape) == 3:
        return LayoutKind.MLA
    raise LayoutError(
        f"{name}: cannot detect KV layout from shape {list(shape)} (expected "
        "[2, blocks, block_size, heads, head_dim], [blocks, heads, block_size, 2*head_dim] "
        "or [blocks, block_size, latent_dim])"
    )


def _geometry(kind: LayoutKind, name: str, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of one layer's shape."""
    rank = {LayoutKind.FLASH: 5, LayoutKind.CPU: 4, LayoutKind.MLA: 3}[kind]
    if len(shape) != rank or (kind is LayoutKind.FLASH and shape[0] != 2):
        raise LayoutError(f"{name}: shape {list(shape)} does not fit the {kind.value} layout")
    if kind is LayoutKind.FLASH:
        return shape[1], shape[2], shape[3], shape[4]
    if kind is LayoutKind.CPU:
        if shape[3] % 2:
            raise LayoutError(f"{name}: CPU layout last dim {shape[3]} is not 2*head_dim")
        return shape[0], shape[2], shape[1], shape[3] // 2
    return shape[0], shape[1], 1, shape[2]


def _check_same(
    ref_name: str,
    ref: torch.Tensor,
    name: str,
    tensor: torch.Tensor,
    fields: tuple[str, ...] = ("shape", "dtype", "device"),
) -> None:
    for what in fields:
        mine, theirs = getattr(tensor, what), getattr(ref, what)
        if mine != theirs:
            raise LayoutError(f"{name}: {what} {mine} differs from {ref_name}'s {theirs}")


def _check_segments(layout: KVLayout, name: str, tensor: torch.Tensor) -> None:
    """Check ``tensor`` has the layout's shape and dense, non-overlapping segments."""
    shape = tuple(tensor.shape)
    want = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = str(tensor.dtype).removeprefix("torch.")
    if _geometry(layout.kind, name, shape) != want or dtype != layout.dtype:
        raise LayoutError(f"{name}: shape {list(shape)} {dtype} does not match {layout}")
    inner = 2 if layout.kind is LayoutKind.FLASH else 1  # dims inside one segment
    if not _is_dense(shape[inner:], tensor.stride()[inner:]):
        raise LayoutError(
            f"{name}: a block's segment is not contiguous (shape {list(shape)}, "
            f"strides {list(tensor.stride())}); fabric copies whole block segments"
        )
    seg_elems = layout.segment_bytes // layout.element_size
    block_stride = tensor.stride(inner - 1)
    if layout.num_blocks > 1 and block_stride < seg_elems:
        raise LayoutError(f"{name}: blocks overlap (block stride {block_stride})")
    if layout.kind is LayoutKind.FLASH and not _kv_disjoint(
        tensor.stride(0), block_stride, seg_elems, layout.num_blocks
    ):
        raise LayoutError(f"{name}: K and V overlap (strides {list(tensor.stride())})")


def _kv_disjoint(kv_stride: int, block_stride: int, seg_elems: int, num_blocks: int) -> bool:
    """True when FLASH K and V segments cannot share memory.

    Either all of K comes before V (``[2, blocks, ...]`` storage) or K and V
    alternate inside each block (``[blocks, 2, ...]`` storage viewed as FLASH).
    """
    k_then_v = kv_stride >= (num_blocks - 1) * block_stride + seg_elems
    interleaved = seg_elems <= kv_stride and kv_stride + seg_elems <= block_stride
    return k_then_v or interleaved


def _is_dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when a row-major tensor of ``shape`` with ``strides`` has no gaps."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
