"""KV geometries of known models and paged caches to benchmark with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fabric.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVGeometry:
    """What decides KV bytes per token: layers, KV heads, head size, dtype."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def element_size(self) -> int:
        return 1 if "float8" in self.dtype else 4 if self.dtype == "float32" else 2

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size


PRESETS = {
    g.name: g
    for g in (
        KVGeometry("tiny", 4, 2, 64),
        KVGeometry("tiny-kv-heavy", 32, 8, 128),
        KVGeometry("llama3-8b", 32, 8, 128),
        KVGeometry("llama3-70b", 80, 8, 128),
    )
}


def preset(name: str) -> KVGeometry:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"geometry: unknown preset {name!r} (known: {sorted(PRESETS)})") from None


def paged_cache(
    geom: KVGeometry, kind: str, num_blocks: int, block_size: int, *, seed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One random-filled allocation and its per-layer views, as vLLM lays them out.

    ``kind``: ``flash`` -> ``[2, blocks, block_size, heads, head_dim]`` per
    layer; ``cpu`` -> ``[blocks, heads, block_size, 2 * head_dim]``.
    """
    import torch

    dtype = getattr(torch, geom.dtype)
    if kind == "flash":
        shape: tuple[int, ...] = (2, num_blocks, block_size, geom.num_kv_heads, geom.head_dim)
    elif kind == "cpu":
        shape = (num_blocks, geom.num_kv_heads, block_size, 2 * geom.head_dim)
    else:
        raise ConfigError(f"layout: unknown kind {kind!r} (flash, cpu)")
    storage = torch.empty((geom.num_layers, *shape), dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    raw = storage.view(torch.uint8).view(-1)
    step = 64 << 20
    for start in range(0, raw.numel(), step):
        part = raw[start : start + step]
        part.copy_(torch.randint(0, 256, (part.numel(),), dtype=torch.uint8, generator=gen))
    return storage, list(storage.unbind(0))
