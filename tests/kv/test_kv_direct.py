"""The direct path's plan: pairs of pieces between two paged caches, and their checksum."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
import torch

from fabric.errors import LayoutError
from fabric.kv import KVLayout, LayoutKind, pack, unpack
from fabric.kv.direct import cache_spans, checksum_spans, direct_plan
from fabric.kv.layerwise import group_ends
from fabric.store import checksum

MakeCaches = Callable[..., list[torch.Tensor]]
KINDS = [LayoutKind.CPU, LayoutKind.FLASH, LayoutKind.MLA]
SRC_IDS = [7, 2, 3, 4, 0, 11]
DST_IDS = [1, 8, 9, 10, 5, 6]


def raw(tensors: list[torch.Tensor]) -> list[bytes]:
    return [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


def copy(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def packed(caches: list[torch.Tensor], layout: KVLayout, ids: list[int]) -> torch.Tensor:
    buf = torch.empty(layout.chunk_nbytes(len(ids)), dtype=torch.uint8)
    pack(caches, layout, ids, buf)
    return buf


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "dst_ids", [DST_IDS, SRC_IDS, [3, 4, 5, 6, 7, 8]], ids=["scattered", "same-ids", "one-run"]
)
def test_plan_moves_the_chunk_and_checksums_like_a_pack(
    make_caches: MakeCaches, kind: LayoutKind, dst_ids: list[int]
) -> None:
    src = make_caches(kind, num_layers=4)
    dst = [torch.zeros_like(c) for c in src]
    layout = KVLayout.from_tensors(src)
    plan = direct_plan(cache_spans(src, layout, SRC_IDS), cache_spans(dst, layout, dst_ids))
    chunk = packed(src, layout, SRC_IDS)
    want = checksum(chunk)

    assert int(plan.lengths.sum()) == plan.nbytes == layout.chunk_nbytes(len(SRC_IDS))
    assert checksum_spans(plan.src, plan.lengths) == want
    copy(plan.src, plan.dst, plan.lengths)
    assert checksum_spans(plan.dst, plan.lengths) == want
    expected = [torch.zeros_like(c) for c in src]
    unpack(chunk, expected, layout, dst_ids)
    assert raw(dst) == raw(expected)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_groups_tile_the_plan_and_hash_on_into_the_chunk_checksum(
    make_caches: MakeCaches, kind: LayoutKind
) -> None:
    import xxhash

    src = make_caches(kind, num_layers=5)
    layout = KVLayout.from_tensors(src)
    dst = [torch.zeros_like(c) for c in src]
    plan = direct_plan(cache_spans(src, layout, SRC_IDS), cache_spans(dst, layout, DST_IDS))
    hasher = xxhash.xxh3_64()
    start = 0
    for end in group_ends(layout.num_layers, 2):
        group = plan.layers(layout, len(SRC_IDS), start, end)
        copy(group.src, group.dst, group.lengths)
        checksum_spans(group.dst, group.lengths, hasher)
        start = end
    assert hasher.intdigest() == checksum(packed(src, layout, SRC_IDS))
    assert raw(dst) != raw([torch.zeros_like(c) for c in src])


def test_contiguous_runs_on_both_sides_merge(make_caches: MakeCaches) -> None:
    src = make_caches(LayoutKind.CPU, num_layers=2)
    layout = KVLayout.from_tensors(src)
    dst = [torch.zeros_like(c) for c in src]
    ids = [3, 4, 5, 6]
    same = direct_plan(cache_spans(src, layout, ids), cache_spans(dst, layout, ids))
    # NOTE: CPU layout: one piece per layer and run, blocks back to back
    assert len(same) == layout.num_layers
    cut = direct_plan(cache_spans(src, layout, ids), cache_spans(dst, layout, [3, 4, 9, 10]))
    assert len(cut) == 2 * layout.num_layers


def test_between_cuts_pieces_and_refuses_ranges_outside(make_caches: MakeCaches) -> None:
    src = make_caches(LayoutKind.FLASH, num_layers=2)
    layout = KVLayout.from_tensors(src)
    plan = direct_plan(cache_spans(src, layout, SRC_IDS), cache_spans(src, layout, DST_IDS))
    part = plan.between(5, plan.nbytes - 7)
    assert int(part.lengths.sum()) == plan.nbytes - 12
    assert part.offsets[0] == 5 and part.src[0] == plan.src[0] + 5
    with pytest.raises(ValueError, match="outside"):
        plan.between(0, plan.nbytes + 1)


def test_mismatched_chunks_are_refused(make_caches: MakeCaches) -> None:
    src = make_caches(LayoutKind.FLASH)
    layout = KVLayout.from_tensors(src)
    with pytest.raises(LayoutError, match="bytes"):
        direct_plan(cache_spans(src, layout, [1, 2]), cache_spans(src, layout, [3]))


def test_a_changed_source_byte_changes_the_checksum(make_caches: MakeCaches) -> None:
    src = make_caches(LayoutKind.FLASH, num_layers=3)
    layout = KVLayout.from_tensors(src)
    plan = direct_plan(cache_spans(src, layout, SRC_IDS), cache_spans(src, layout, DST_IDS))
    before = checksum_spans(plan.src, plan.lengths)
    flat = src[2].view(-1).view(torch.uint8)
    block = SRC_IDS[-1]
    # NOTE: the last block's V segment of the last layer: inside the chunk
    at = (flat.numel() // 2) + block * (flat.numel() // 2 // src[2].shape[1])
    flat[at] ^= 0xFF
    assert checksum_spans(plan.src, plan.lengths) != before


def test_cache_regions_merge_layers_of_one_allocation(make_caches: MakeCaches) -> None:
    from fabric.kv.direct import cache_regions

    apart = make_caches(LayoutKind.FLASH, num_layers=3)
    assert sorted(n for _, n in cache_regions(apart)) == [apart[0].untyped_storage().nbytes()] * 3
    whole = torch.zeros(3 * apart[0].numel(), dtype=apart[0].dtype)
    shared = list(whole.view(3, *apart[0].shape).unbind(0))
    assert cache_regions(shared) == [(whole.data_ptr(), whole.untyped_storage().nbytes())]


@pytest.mark.parametrize("kind", KINDS)
def test_a_peers_cache_map_gives_the_same_spans(make_caches: MakeCaches, kind: LayoutKind) -> None:
    import msgspec

    from fabric.kv.direct import CacheMap, cache_map, map_spans

    caches = make_caches(kind, num_layers=3)
    layout = KVLayout.from_tensors(caches)
    wire = msgspec.msgpack.encode(cache_map(caches, layout))
    got = map_spans(msgspec.msgpack.decode(wire, type=CacheMap), layout, SRC_IDS)
    want = cache_spans(caches, layout, SRC_IDS)
    for name in ("offsets", "addrs", "lengths"):
        assert np.array_equal(getattr(got, name), getattr(want, name))
    assert got.nbytes == want.nbytes


def test_a_cache_map_that_does_not_fit_or_ids_outside_it_are_refused(
    make_caches: MakeCaches,
) -> None:
    from fabric.kv.direct import cache_map, map_spans

    caches = make_caches(LayoutKind.FLASH, num_layers=3, num_blocks=12)
    layout = KVLayout.from_tensors(caches)
    cmap = cache_map(caches, layout)
    assert cmap.num_blocks == 12
    with pytest.raises(LayoutError, match="outside"):
        map_spans(cmap, layout, [3, 12])
    with pytest.raises(LayoutError, match="outside"):
        map_spans(cmap, layout, [-1])
    other = KVLayout.from_tensors(make_caches(LayoutKind.FLASH, num_layers=2))
    with pytest.raises(LayoutError, match="does not fit"):
        map_spans(cmap, other, [1])


def test_empty_or_zero_pieces_and_empty_ranges_are_refused_or_empty(
    make_caches: MakeCaches,
) -> None:
    from fabric.kv.direct import Spans

    src = make_caches(LayoutKind.FLASH, num_layers=2)
    layout = KVLayout.from_tensors(src)
    full = cache_spans(src, layout, SRC_IDS)
    none = np.zeros(0, dtype=np.int64)
    with pytest.raises(LayoutError, match="tile"):
        direct_plan(Spans(none, none, none, full.nbytes), full)
    plan = direct_plan(full, full)
    assert len(plan.between(5, 5)) == 0  # NOTE: not a zero-length piece
    with pytest.raises(ValueError, match="not this plan"):
        plan.layers(layout, len(SRC_IDS) + 1, 0, 1)


def test_a_peer_of_another_dtype_with_the_same_sizes_is_refused(make_caches: MakeCaches) -> None:
    from fabric.kv.direct import cache_map, map_spans

    bf16 = make_caches(LayoutKind.FLASH, torch.bfloat16)
    fp16 = make_caches(LayoutKind.FLASH, torch.float16)
    ours = KVLayout.from_tensors(bf16)
    assert ours.segment_bytes == KVLayout.from_tensors(fp16).segment_bytes
    with pytest.raises(LayoutError, match="does not fit"):
        map_spans(cache_map(fp16, KVLayout.from_tensors(fp16)), ours, [1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cuts", [[1, 3, 5], [2, 2, 4, 5], [5]], ids=["groups", "repeats", "whole"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-tensors", "one-allocation"])
def test_a_chunk_hashed_in_its_blocks_layer_group_by_group_is_the_packed_checksum(
    make_caches: MakeCaches, kind: LayoutKind, cuts: list[int], shared: bool
) -> None:
    from fabric.kv.layerwise import LayerwiseHash
    from fabric.kv.layout import segment_table

    caches = make_caches(kind, num_layers=5)
    ids = SRC_IDS
    if shared:
        # NOTE: layers back to back in one allocation, and a chunk whose last
        # piece in a layer ends where the next layer's first begins: hashed
        # as one range would still give the digest, but not a layer at a time
        caches = list(torch.stack(caches).unbind(0))
        ids = [0, 1, caches[0].shape[1 if kind is LayoutKind.FLASH else 0] - 1]
    layout = KVLayout.from_tensors(caches)
    block_dim = 1 if kind is LayoutKind.FLASH else 0

    def flip(block: int, at: int, layer: int = -1) -> None:
        data = caches[layer].select(block_dim, block).view(torch.uint8)
        data[(at,) * data.dim()] ^= 0xFF

    for table in (None, segment_table(caches, layout)):
        hashing = LayerwiseHash(caches, layout, ids, table)
        for upto in cuts:
            before = hashing.layers_done
            hashing.hash_layers(upto)
            assert hashing.layers_done == upto
            if before < upto < layout.num_layers:
                flip(ids[0], 0, upto)  # NOTE: the forward writes the next layer only now
        assert hashing.finish() == checksum(packed(caches, layout, ids))
    want = checksum(packed(caches, layout, ids))
    # NOTE: a byte of the chunk's last block in its last layer counts; a block outside does not

    other = make_caches(kind, num_layers=5, seed=1)
    with pytest.raises(LayoutError, match="not this cache's"):
        LayerwiseHash(caches, layout, ids, segment_table(other, layout))
    flip(next(b for b in range(layout.num_blocks) if b not in ids), 0)
    assert LayerwiseHash(caches, layout, ids).finish() == want
    flip(ids[-1], -1)
    changed = LayerwiseHash(caches, layout, ids)
    changed.hash_layers(4)
    assert changed.finish() != want
