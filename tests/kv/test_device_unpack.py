"""Unpacking into a cache on an accelerator, in order: a chunk in the cache's
device memory (a VRAM pool's slot) is verified there with fold64 before any of
it is copied, and unpack returns only once the copy has read the chunk (the
slot is released right after, and the next NIXL WRITE into it is outside any
stream order). The cache here is on torch's ``meta`` device and the kernels
are a recording fake: the order of calls is what is tested."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
import torch

from fabric.errors import ChecksumMismatch, LayoutError
from fabric.kv import KVLayout, LayoutKind, unpack

pack_mod = importlib.import_module("fabric.kv.pack")  # fabric.kv.pack is also a function
IDS = [3, 1, 2]


class RecordingKernels:
    def __init__(self, calls: list[Any], *, events: bool = True) -> None:
        self.calls = calls
        if events:
            self.synchronize = lambda: calls.append("synchronize")

    def pack(self, views: list[torch.Tensor], ids: np.ndarray, dst: torch.Tensor) -> None:
        self.calls.append("pack")

    def unpack(self, src: torch.Tensor, views: list[torch.Tensor], ids: np.ndarray) -> None:
        self.calls.append(("unpack", src.device.type, src.numel(), ids.tolist()))


@pytest.fixture
def meta_cache() -> tuple[list[torch.Tensor], KVLayout]:
    caches = [torch.empty(2, 16, 16, 4, 8, dtype=torch.float16, device="meta") for _ in range(2)]
    return caches, KVLayout.from_tensors(caches, kind=LayoutKind.FLASH)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    recorded: list[Any] = []
    monkeypatch.setattr(pack_mod, "device_kernels", lambda kind: RecordingKernels(recorded))
    return recorded


def test_unpack_waits_for_the_copy_before_it_returns(
    meta_cache: tuple[list[torch.Tensor], KVLayout], calls: list[Any]
) -> None:
    caches, layout = meta_cache
    nbytes = layout.chunk_nbytes(len(IDS))
    src = torch.zeros(nbytes, dtype=torch.uint8)  # a host (pinned) slot
    assert unpack(src, caches, layout, IDS) == nbytes
    assert calls == [("unpack", "cpu", nbytes, IDS), "synchronize"]


def test_a_chunk_in_device_memory_is_hashed_there_before_it_is_copied(
    meta_cache: tuple[list[torch.Tensor], KVLayout],
    calls: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caches, layout = meta_cache
    nbytes = layout.chunk_nbytes(len(IDS))
    slot = torch.empty(nbytes + 512, dtype=torch.uint8, device="meta")  # a VRAM slot, padded

    def fold64(data: torch.Tensor) -> int:
        calls.append(("fold64", data.device.type, data.numel()))
        return 77

    monkeypatch.setattr(pack_mod, "fold64", fold64)
    assert (
        unpack(slot, caches, layout, IDS, checksum=77, nbytes=nbytes, checksum_kind="fold64")
        == nbytes
    )
    assert calls == [("fold64", "meta", nbytes), ("unpack", "meta", nbytes, IDS), "synchronize"]
    calls.clear()
    with pytest.raises(ChecksumMismatch):
        unpack(slot, caches, layout, IDS, checksum=78, nbytes=nbytes, checksum_kind="fold64")
    assert calls == [("fold64", "meta", nbytes)], "a chunk that fails is not copied"


def test_a_chunk_on_another_device_is_refused(
    meta_cache: tuple[list[torch.Tensor], KVLayout], calls: list[Any]
) -> None:
    _, layout = meta_cache
    cpu_caches = [torch.zeros(2, 16, 16, 4, 8, dtype=torch.float16) for _ in range(2)]
    slot = torch.empty(layout.chunk_nbytes(len(IDS)), dtype=torch.uint8, device="meta")
    with pytest.raises(LayoutError, match="src is on meta but the KV cache is on the CPU"):
        unpack(slot, cpu_caches, layout, IDS, checksum=1)
    assert calls == []
