"""Shared builders for fabric.kv tests: random paged caches of every layout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fabric.kv import LayoutKind


def cache_shape(
    kind: LayoutKind, num_blocks: int, block_size: int, heads: int, head_dim: int
) -> tuple[int, ...]:
    """The per-layer tensor shape vLLM uses for ``kind``."""
    if kind is LayoutKind.FLASH:
        return (2, num_blocks, block_size, heads, head_dim)
    if kind is LayoutKind.CPU:
        return (num_blocks, heads, block_size, 2 * head_dim)
    return (num_blocks, block_size, head_dim)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of random bytes (any bit pattern, NaNs included) viewed as ``dtype``."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


@pytest.fixture
def make_caches() -> Callable[..., list[torch.Tensor]]:
    """Build ``num_layers`` random cache tensors of one layout."""

    def make(
        kind: LayoutKind,
        dtype: torch.dtype = torch.bfloat16,
        *,
        num_layers: int = 3,
        num_blocks: int = 12,
        block_size: int = 4,
        heads: int = 2,
        head_dim: int = 8,
        seed: int = 0,
    ) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        heads = 1 if kind is LayoutKind.MLA else heads
        shape = cache_shape(kind, num_blocks, block_size, heads, head_dim)
        return [random_tensor(shape, dtype, gen) for _ in range(num_layers)]

    return make
