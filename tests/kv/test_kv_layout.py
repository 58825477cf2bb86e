"""KVLayout detection, derived sizes, validation and fingerprints."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np
import pytest
import torch

from fabric.errors import LayoutError, LayoutMismatch
from fabric.kv import KVLayout, LayoutKind
from fabric.kv.layout import FINGERPRINT_FIELDS, segment_table

MakeCaches = Callable[..., list[torch.Tensor]]

LLAMA_FLASH = KVLayout(
    kind=LayoutKind.FLASH,
    num_layers=32,
    num_blocks=1000,
    block_size=16,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    element_size=2,
    model="meta-llama/Meta-Llama-3-8B",
)

# NOTE: computed once; a change means every deployed engine's fingerprint changes.
LLAMA_FLASH_FINGERPRINT = "730cb95f5aaa2d4b8ab9d873fcd41d95dafeb3b3b4d723357310afc576ef1f55"


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_from_tensors_detects_kind_and_geometry(make_caches: MakeCaches, kind: LayoutKind) -> None:
    caches = make_caches(kind, num_layers=4, num_blocks=12, block_size=4, heads=2, head_dim=8)
    layout = KVLayout.from_tensors(caches, model="m", tp_rank=1, tp_size=2)
    heads = 1 if kind is LayoutKind.MLA else 2
    assert (layout.kind, layout.num_layers, layout.num_blocks) == (kind, 4, 12)
    assert (layout.block_size, layout.num_kv_heads, layout.head_dim) == (4, heads, 8)
    assert (layout.dtype, layout.element_size) == ("bfloat16", 2)
    assert (layout.model, layout.tp_rank, layout.tp_size) == ("m", 1, 2)


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_sizes_match_tensor_bytes(make_caches: MakeCaches, kind: LayoutKind) -> None:
    caches = make_caches(kind, torch.float32)
    layout = KVLayout.from_tensors(caches)
    total = sum(t.numel() * t.element_size() for t in caches)
    assert layout.chunk_nbytes(layout.num_blocks) == total
    assert layout.segments == (2 if kind is LayoutKind.FLASH else 1)
    assert layout.block_bytes == layout.num_layers * layout.segments * layout.segment_bytes
    assert layout.bytes_per_token * layout.block_size == layout.block_bytes


def test_llama_geometry_is_128_kib_per_token() -> None:
    cpu = dataclasses.replace(LLAMA_FLASH, kind=LayoutKind.CPU, block_size=128)
    assert LLAMA_FLASH.bytes_per_token == cpu.bytes_per_token == 128 * 1024
    assert LLAMA_FLASH.segment_bytes == 32 * 1024
    assert cpu.segment_bytes == 512 * 1024


def test_from_tensors_accepts_named_dict(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.CPU)
    named = {f"model.layers.{i}.self_attn": t for i, t in enumerate(caches)}
    assert KVLayout.from_tensors(named) == KVLayout.from_tensors(caches)


def test_explicit_kind_overrides_detection(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.CPU)
    assert KVLayout.from_tensors(caches, kind="cpu").kind is LayoutKind.CPU
    with pytest.raises(LayoutError, match="does not fit the flash layout"):
        KVLayout.from_tensors(caches, kind=LayoutKind.FLASH)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t[:, :-1], r"layer\[2\]: shape .* differs from layer\[0\]"),
        (lambda t: t.float(), r"layer\[2\]: dtype torch.float32 differs"),
    ],
)
def test_mismatched_layers_are_named(make_caches: MakeCaches, mutate, message: str) -> None:
    caches = make_caches(LayoutKind.FLASH)
    caches[2] = mutate(caches[2])
    with pytest.raises(LayoutError, match=message):
        KVLayout.from_tensors(caches)


def test_undetectable_shape() -> None:
    with pytest.raises(LayoutError, match=r"cannot detect KV layout from shape \[3, 4, 4, 2, 8\]"):
        KVLayout.from_tensors({"attn.0": torch.zeros(3, 4, 4, 2, 8)})
    with pytest.raises(LayoutError, match="no KV cache tensors"):
        KVLayout.from_tensors([])


def test_non_contiguous_segment_is_rejected() -> None:
    padded = torch.zeros(6, 2, 4, 20)[..., :16]  # last dim padded: a block has gaps
    with pytest.raises(LayoutError, match=r"layer\[0\]: a block's segment is not contiguous"):
        KVLayout.from_tensors([padded])
    permuted = torch.zeros(2, 6, 2, 4, 8).transpose(2, 3)  # heads-major inside a block
    with pytest.raises(LayoutError, match="not contiguous"):
        KVLayout.from_tensors([permuted])


def test_overlapping_views_are_rejected() -> None:
    expanded = torch.zeros(1, 2, 4, 16).expand(6, 2, 4, 16)
    with pytest.raises(LayoutError, match="blocks overlap"):
        KVLayout.from_tensors([expanded])
    k_is_v = torch.zeros(1, 6, 4, 2, 8).expand(2, 6, 4, 2, 8)
    with pytest.raises(LayoutError, match="K and V overlap"):
        KVLayout.from_tensors([k_is_v])


def test_strided_blocks_give_segment_table_strides() -> None:
    # K and V interleaved per block ([blocks, 2, ...] storage seen as FLASH).
    storage = torch.zeros(6, 2, 4, 2, 8, dtype=torch.float16)
    layout = KVLayout.from_tensors([storage.transpose(0, 1)])
    table = segment_table([storage.transpose(0, 1)], layout)
    base = storage.data_ptr()
    assert table.bases.tolist() == [base, base + layout.segment_bytes]
    assert table.block_strides.tolist() == [2 * layout.segment_bytes] * 2
    assert not table.blocks_adjacent


def test_fingerprint_is_stable_and_ignores_num_blocks() -> None:
    assert LLAMA_FLASH.fingerprint() == LLAMA_FLASH_FINGERPRINT
    fewer_blocks = dataclasses.replace(LLAMA_FLASH, num_blocks=7)
    assert fewer_blocks.fingerprint() == LLAMA_FLASH_FINGERPRINT
    LLAMA_FLASH.check_compatible(fewer_blocks)


def test_fingerprint_is_blake3_of_sorted_json() -> None:
    canonical = (
        '{"block_size":16,"dtype":"bfloat16","format":1,"head_dim":128,"kind":"flash",'
        '"model":"meta-llama/Meta-Llama-3-8B","num_kv_heads":8,"num_layers":32,'
        '"tp_rank":0,"tp_size":1}'
    )
    assert blake3.blake3(canonical.encode()).hexdigest() == LLAMA_FLASH_FINGERPRINT


def test_fingerprint_same_in_subprocess() -> None:
    code = (
        "from fabric.kv import KVLayout, LayoutKind\n"
        "print(KVLayout(LayoutKind.FLASH, 32, 5, 16, 8, 128, 'bfloat16', 2,"
        " model='meta-llama/Meta-Llama-3-8B').fingerprint())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == LLAMA_FLASH_FINGERPRINT


CHANGES: dict[str, dict[str, object]] = {
    "kind": {"kind": LayoutKind.CPU},
    "num_layers": {"num_layers": 31},
    "block_size": {"block_size": 32},
    "num_kv_heads": {"num_kv_heads": 4},
    "head_dim": {"head_dim": 64},
    "dtype": {"dtype": "float16"},
    "model": {"model": "other"},
    "tp_rank": {"tp_rank": 1, "tp_size": 2},  # tp_rank is named first
    "tp_size": {"tp_size": 2},
}


@pytest.mark.parametrize("field", FINGERPRINT_FIELDS)
def test_mismatch_names_the_field(field: str) -> None:
    other = dataclasses.replace(LLAMA_FLASH, **CHANGES[field])  # type: ignore[arg-type]
    assert other.fingerprint() != LLAMA_FLASH.fingerprint()
    with pytest.raises(LayoutMismatch, match=f"KV layouts differ in {field}: local"):
        LLAMA_FLASH.check_compatible(other)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_blocks", 0, "num_blocks must be > 0"),
        ("tp_rank", 3, "tp_rank 3 out of range"),
        ("head_dim", 0, "head_dim"),
    ],
)
def test_invalid_layout_fields(field: str, value: int, message: str) -> None:
    changes: dict[str, Any] = {field: value}
    with pytest.raises(LayoutError, match=message):
        dataclasses.replace(LLAMA_FLASH, **changes)


def test_mla_needs_one_head() -> None:
    with pytest.raises(LayoutError, match="MLA layout needs num_kv_heads == 1"):
        dataclasses.replace(LLAMA_FLASH, kind=LayoutKind.MLA)


def test_segment_table_checks_layer_count_and_device(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.MLA)
    layout = KVLayout.from_tensors(caches)
    with pytest.raises(LayoutError, match="expected 3 layers, got 2"):
        segment_table(caches[:2], layout)
    table = segment_table(caches, layout)
    assert table.bases.dtype == np.int64
    assert table.bases.tolist() == [t.data_ptr() for t in caches]
