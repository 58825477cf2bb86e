"""KV geometries of known models and paged caches to benchmark with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fabric.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVGeometry:
    """What decides KV bytes per token: layers, KV heads, head size, dtype.

    ``mla``: one latent vector per token and layer (DeepSeek's MLA), stored
    once instead of as K and V; ``num_kv_heads`` is then 1 and ``head_dim``
    the latent width.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    mla: bool = False

    @property
    def element_size(self) -> int:
        return 1 if "float8" in self.dtype else 4 if self.dtype == "float32" else 2

    @property
    def segments(self) -> int:
        """Regions per layer: K and V, or the one MLA latent."""
        return 1 if self.mla else 2

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.num_kv_heads * self.head_dim * self.element_size
        return self.segments * self.num_layers * per_layer

    def layout_kind(self, kind: str) -> str:
        """The paged-cache kind to build: MLA geometries are always ``mla``."""
        return "mla" if self.mla else kind


PRESETS = {
    g.name: g
    for g in (
        KVGeometry("tiny", 4, 2, 64),
        KVGeometry("tiny-kv-heavy", 32, 8, 128),
        KVGeometry("llama3-8b", 32, 8, 128),
        KVGeometry("llama3-70b", 80, 8, 128),
        # NOTE: DeepSeek-V3/R1: kv_lora_rank 512 + rope dim 64 per token and layer.
        KVGeometry("deepseek-mla", 61, 1, 576, mla=True),
    )
}


def preset(name: str) -> KVGeometry:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"geometry: unknown preset {name!r} (known: {sorted(PRESETS)})") from None


def cache_shape(geom: KVGeometry, kind: str, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's paged-cache shape, as vLLM lays it out.

    ``flash`` -> ``[2, blocks, block_size, heads, head_dim]``; ``cpu`` ->
    ``[blocks, heads, block_size, 2 * head_dim]``; ``mla`` -> ``[blocks,
    block_size, latent]``.
    """
    kind = geom.layout_kind(kind)
    if geom.mla and kind != "mla":
        raise ConfigError(f"layout: {geom.name} is an MLA geometry")
    if kind == "flash":
        return (2, num_blocks, block_size, geom.num_kv_heads, geom.head_dim)
    if kind == "cpu":
        return (num_blocks, geom.num_kv_heads, block_size, 2 * geom.head_dim)
    if kind == "mla":
        if not geom.mla:
            raise ConfigError(f"layout: {geom.name} is not an MLA geometry")
        return (num_blocks, block_size, geom.head_dim)
    raise ConfigError(f"layout: unknown kind {kind!r} (flash, cpu, mla)")


def paged_cache(
    geom: KVGeometry,
    kind: str,
    num_blocks: int,
    block_size: int,
    *,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One pattern-filled allocation and its per-layer views (see :func:`cache_shape`).

    Every block segment holds different bytes (see :func:`fill_pattern`), so a
    block copied to the wrong place changes a checksum.
    """
    import torch

    shape = cache_shape(geom, kind, num_blocks, block_size)
    storage = torch.empty((geom.num_layers, *shape), dtype=getattr(torch, geom.dtype))
    segment_bytes = block_size * geom.num_kv_heads * geom.head_dim * geom.element_size
    if geom.layout_kind(kind) == "cpu":
        segment_bytes *= 2
    fill_pattern(storage, segment_bytes, seed)
    if device != "cpu":
        storage = storage.to(device)
    return storage, list(storage.unbind(0))


def fill_pattern(storage: torch.Tensor, segment_bytes: int, seed: int) -> None:
    """Fill ``storage`` with a seeded random tile, then stamp every segment.

    NOTE: drawing every byte at random costs seconds per GiB here (torch's
    ``randint`` ~30 MB/s on a loaded core); a 1 MiB random tile copied over
    the region runs at memcpy speed, and the stamp (seed, segment number) in
    each segment's first 8 bytes keeps all segments distinct.
    """
    import numpy as np
    import torch

    raw = storage.view(torch.uint8).view(-1).numpy()
    rng = np.random.default_rng(seed)
    # NOTE: one byte longer than 1 MiB so consecutive segments see shifted tiles.
    tile = rng.integers(0, 256, (1 << 20) + 1, dtype=np.uint8)
    for start in range(0, raw.size, tile.size):
        part = raw[start : start + tile.size]
        part[:] = tile[: part.size]
    stamps = raw[: raw.size - raw.size % segment_bytes].reshape(-1, segment_bytes)
    ids = np.arange(len(stamps), dtype=np.uint64) | np.uint64((seed & 0xFFFF) << 48)
    stamps[:, :8] = ids.view(np.uint8).reshape(-1, 8)
