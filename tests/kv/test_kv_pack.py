"""pack/unpack: bit-exact round trips, the chunk byte format, backends, errors."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from fabric.errors import ConfigError, LayoutError
from fabric.kv import KVLayout, LayoutKind, backend, pack, unpack
from fabric.kv.pack import Backend, copy_plan

MakeCaches = Callable[..., list[torch.Tensor]]
# NOTE: random bytes include NaN patterns; comparisons are on raw bytes.
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
BACKENDS: list[Backend] = ["c", "torch"] if backend() == "c" else ["torch"]
IDS = [7, 2, 3, 4, 0, 11, 10]  # unordered, with runs (2,3,4) and (11,10 is not a run)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor, flat."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def reference_pack(caches: list[torch.Tensor], layout: KVLayout, ids: list[int]) -> torch.Tensor:
    """The documented chunk format, built slowly with plain indexing."""
    parts = []
    for tensor in caches:
        for s in range(layout.segments):
            for b in ids:
                block = tensor[s, b] if layout.kind is LayoutKind.FLASH else tensor[b]
                parts.append(as_bytes(block))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def blocks_of(tensor: torch.Tensor, layout: KVLayout, ids: list[int]) -> torch.Tensor:
    return tensor[:, ids] if layout.kind is LayoutKind.FLASH else tensor[ids]


def round_trip(
    caches: list[torch.Tensor], ids: list[int], use: Backend, threads: int | None = None
) -> None:
    layout = KVLayout.from_tensors(caches)
    chunk = torch.full((layout.chunk_nbytes(len(ids)) + 64,), 0xA5, dtype=torch.uint8)
    assert pack(
        caches, layout, ids, chunk, backend=use, num_threads=threads
    ) == layout.chunk_nbytes(len(ids))
    assert torch.equal(chunk[: layout.chunk_nbytes(len(ids))], reference_pack(caches, layout, ids))
    assert bool((chunk[layout.chunk_nbytes(len(ids)) :] == 0xA5).all()), "wrote past the chunk"
    fresh = [torch.zeros_like(t) for t in caches]
    unpack(chunk, fresh, layout, ids, backend=use, num_threads=threads)
    others = sorted(set(range(layout.num_blocks)) - set(ids))
    for old, new in zip(caches, fresh, strict=True):
        assert torch.equal(
            as_bytes(blocks_of(new, layout, ids)), as_bytes(blocks_of(old, layout, ids))
        )
        assert not as_bytes(blocks_of(new, layout, others)).any(), "touched other blocks"


@pytest.mark.parametrize("use", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", list(LayoutKind), ids=lambda k: k.value)
def test_round_trip_is_bit_exact(
    make_caches: MakeCaches, kind: LayoutKind, dtype: torch.dtype, use: Backend
) -> None:
    round_trip(make_caches(kind, dtype), IDS, use)


@pytest.mark.parametrize("use", BACKENDS)
@pytest.mark.parametrize("kind", list(LayoutKind), ids=lambda k: k.value)
@pytest.mark.parametrize(
    "ids", [[5], [0, 1, 2, 3], [11, 0], [3, 9, 1], list(range(12)), []], ids=str
)
def test_partial_and_odd_block_lists(
    make_caches: MakeCaches, kind: LayoutKind, ids: list[int], use: Backend
) -> None:
    round_trip(make_caches(kind, torch.float16, seed=len(ids)), ids, use)


@pytest.mark.parametrize("kind", list(LayoutKind), ids=lambda k: k.value)
def test_partial_chunk_is_a_prefix_of_a_full_slot(
    make_caches: MakeCaches, kind: LayoutKind
) -> None:
    caches = make_caches(kind)
    layout = KVLayout.from_tensors(caches)
    slot = torch.zeros(layout.chunk_nbytes(8), dtype=torch.uint8)
    pack(caches, layout, [4, 1, 9], slot)
    assert not slot[layout.chunk_nbytes(3) :].any()
    first_layer = slot[: layout.segments * 3 * layout.segment_bytes]
    assert torch.equal(first_layer, reference_pack(caches[:1], layout, [4, 1, 9]))


@pytest.mark.parametrize("kind", list(LayoutKind), ids=lambda k: k.value)
def test_chunk_offsets_follow_documented_format(make_caches: MakeCaches, kind: LayoutKind) -> None:
    caches = make_caches(kind, torch.float32)
    layout = KVLayout.from_tensors(caches)
    chunk = torch.empty(layout.chunk_nbytes(len(IDS)), dtype=torch.uint8)
    pack(caches, layout, IDS, chunk)
    n, seg = len(IDS), layout.segment_bytes
    for layer, tensor in enumerate(caches):
        for s in range(layout.segments):
            for j, b in enumerate(IDS):
                offset = ((layer * layout.segments + s) * n + j) * seg
                block = tensor[s, b] if kind is LayoutKind.FLASH else tensor[b]
                assert torch.equal(chunk[offset : offset + seg], as_bytes(block))


def test_backends_give_identical_bytes(make_caches: MakeCaches) -> None:
    if backend() != "c":
        pytest.skip("fabric.kv._copy is not built")
    caches = make_caches(LayoutKind.FLASH, torch.bfloat16, num_blocks=40)
    layout = KVLayout.from_tensors(caches)
    ids = np.random.default_rng(0).permutation(40)[:25]
    by_c, by_torch = (torch.empty(layout.chunk_nbytes(25), dtype=torch.uint8) for _ in range(2))
    pack(caches, layout, ids, by_c, backend="c", num_threads=2)
    pack(caches, layout, ids, by_torch, backend="torch")
    assert torch.equal(by_c, by_torch)


def test_consecutive_ids_are_coalesced(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.FLASH)
    layout = KVLayout.from_tensors(caches)
    ids = np.array([3, 4, 5, 9, 1, 2])
    chunk_addrs, cache_addrs, lengths = copy_plan(caches, layout, ids, chunk_addr=0)
    rows = layout.num_layers * layout.segments
    assert len(lengths) == rows * 3  # runs (3,4,5), (9), (1,2)
    seg = layout.segment_bytes
    assert lengths[:3].tolist() == [3 * seg, seg, 2 * seg]
    assert chunk_addrs[:3].tolist() == [0, 3 * seg, 4 * seg]
    assert cache_addrs[0] == caches[0].data_ptr() + 3 * seg


@pytest.mark.parametrize("use", BACKENDS)
def test_strided_blocks_are_not_coalesced(use: Backend) -> None:
    # K and V interleaved per block: consecutive blocks are not adjacent in memory.
    gen = torch.Generator().manual_seed(3)
    storages = [torch.randn(12, 2, 4, 2, 8, generator=gen) for _ in range(2)]
    caches = [s.transpose(0, 1) for s in storages]
    layout = KVLayout.from_tensors(caches)
    assert len(copy_plan(caches, layout, np.array([1, 2, 3]), 0)[2]) == 2 * 2 * 3
    round_trip(caches, [1, 2, 3, 8], use)


@pytest.mark.parametrize("use", BACKENDS)
def test_layers_with_different_strides(make_caches: MakeCaches, use: Backend) -> None:
    caches = make_caches(LayoutKind.FLASH, torch.float16, num_layers=3)
    storage = torch.randn(12, 2, 4, 2, 8, dtype=torch.float16)
    caches[1] = storage.transpose(0, 1)  # same shape, K/V interleaved per block
    round_trip(caches, [1, 2, 3, 8, 0], use)


def test_layer_on_another_device_or_dtype(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.MLA)
    layout = KVLayout.from_tensors(caches)
    chunk = torch.zeros(layout.chunk_nbytes(1), dtype=torch.uint8)
    for bad, what in ((caches[2].to("meta"), "device meta"), (caches[2].half(), "dtype")):
        with pytest.raises(LayoutError, match=rf"layer\[2\]: {what}"):
            pack([*caches[:2], bad], layout, [0], chunk)


@pytest.mark.parametrize("use", BACKENDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_large_chunk_round_trip(make_caches: MakeCaches, use: Backend, threads: int) -> None:
    # Over 4 MiB: the C backend switches to streaming stores and splits across threads.
    caches = make_caches(
        LayoutKind.FLASH, num_layers=2, num_blocks=64, block_size=16, heads=8, head_dim=128
    )
    layout = KVLayout.from_tensors(caches)
    ids = np.random.default_rng(1).permutation(64)[:40].tolist()
    assert layout.chunk_nbytes(len(ids)) > 4 << 20
    round_trip(caches, ids, use, threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_copy_batch_random_unaligned_pieces(threads: int) -> None:
    if backend() != "c":
        pytest.skip("fabric.kv._copy is not built")
    from fabric.kv import _copy  # type: ignore[attr-defined]

    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 70_000, 200).astype(np.int64)
    total = int(lengths.sum())
    src = rng.integers(0, 256, total + 8, dtype=np.uint8)
    src_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + 3  # unaligned pieces
    order = rng.permutation(len(lengths))  # gather them shuffled, like pack
    dst = np.zeros(total + 16, dtype=np.uint8)
    dst_offsets = np.concatenate([[0], np.cumsum(lengths[order])[:-1]]) + 5
    src_addrs = (src.ctypes.data + src_offsets[order]).astype(np.int64)
    dst_addrs = (dst.ctypes.data + dst_offsets).astype(np.int64)
    _copy.copy_batch(dst_addrs, src_addrs, lengths[order], threads)
    pieces = [src[src_offsets[i] : src_offsets[i] + lengths[i]] for i in order]
    assert np.array_equal(dst[5 : 5 + total], np.concatenate(pieces))
    assert not dst[:5].any() and not dst[5 + total :].any()


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_copy_batch_threads_split_bytes_exactly(threads: int) -> None:
    if backend() != "c":
        pytest.skip("fabric.kv._copy is not built")
    from fabric.kv import _copy  # type: ignore[attr-defined]

    rng = np.random.default_rng(threads)
    src = rng.integers(0, 256, 9 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    lengths = np.array([0, 5 << 20, 1, 0, (4 << 20) - 7, 6], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    _copy.copy_batch(dst.ctypes.data + offsets, src.ctypes.data + offsets, lengths, threads)
    assert np.array_equal(dst, src)


def test_copy_batch_rejects_bad_buffers() -> None:
    if backend() != "c":
        pytest.skip("fabric.kv._copy is not built")
    from fabric.kv import _copy  # type: ignore[attr-defined]

    ok = np.zeros(2, dtype=np.int64)
    with pytest.raises(TypeError, match="lengths must be a 1-D int64 buffer"):
        _copy.copy_batch(ok, ok, np.zeros(2, dtype=np.int32))
    with pytest.raises(ValueError, match="differ in length"):
        _copy.copy_batch(ok, ok, np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match=r"lengths\[1\] is negative"):
        _copy.copy_batch(ok, ok, np.array([0, -1]))
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        _copy.copy_batch(ok, ok, ok, 0)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 12], r"block id 12 \(position 1\) out of range \[0, 12\)"),
        ([-1], r"block id -1 \(position 0\) out of range"),
        ([[1, 2]], "block_ids must be a 1-D sequence of ints"),
        ([1.0], "block_ids must be a 1-D sequence of ints"),
    ],
)
def test_bad_block_ids(make_caches: MakeCaches, ids: list, message: str) -> None:
    caches = make_caches(LayoutKind.CPU)
    layout = KVLayout.from_tensors(caches)
    chunk = torch.zeros(layout.chunk_nbytes(4), dtype=torch.uint8)
    with pytest.raises(LayoutError, match=message):
        pack(caches, layout, ids, chunk)
    with pytest.raises(LayoutError, match=message):
        unpack(chunk, caches, layout, ids)


def test_unpack_refuses_repeated_blocks(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.MLA)
    layout = KVLayout.from_tensors(caches)
    chunk = torch.zeros(layout.chunk_nbytes(3), dtype=torch.uint8)
    with pytest.raises(LayoutError, match="repeat a block"):
        unpack(chunk, caches, layout, [1, 2, 1])


def test_small_or_wrong_buffer(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.FLASH)
    layout = KVLayout.from_tensors(caches)
    need = layout.chunk_nbytes(3)
    small = torch.zeros(need - 1, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=f"dst holds {need - 1} bytes, .* 3 blocks needs {need}"):
        pack(caches, layout, [0, 1, 2], small)
    with pytest.raises(LayoutError, match=f"src holds {need - 1} bytes"):
        unpack(small, caches, layout, [0, 1, 2])
    wrong = (
        torch.zeros(need, dtype=torch.int8),
        torch.zeros(2, need, dtype=torch.uint8),
        torch.zeros(2 * need, dtype=torch.uint8)[::2],
    )
    for bad in wrong:
        with pytest.raises(LayoutError, match="contiguous 1-D uint8"):
            pack(caches, layout, [0, 1, 2], bad)


def test_caches_that_do_not_match_layout(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.FLASH)
    layout = KVLayout.from_tensors(caches)
    chunk = torch.zeros(layout.chunk_nbytes(1), dtype=torch.uint8)
    with pytest.raises(LayoutError, match="expected 3 layers, got 2"):
        pack(caches[:2], layout, [0], chunk)
    with pytest.raises(LayoutError, match=r"layer\[0\]: shape .* float16 does not match"):
        pack([t.view(torch.float16) for t in caches], layout, [0], chunk)
    caches[1] = caches[1][:, :6]
    with pytest.raises(LayoutError, match=r"layer\[1\]: shape \[2, 6, 4, 2, 8\]"):
        pack(caches, layout, [0], chunk)


def test_unknown_backend(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.MLA)
    layout = KVLayout.from_tensors(caches)
    chunk = torch.zeros(layout.chunk_nbytes(1), dtype=torch.uint8)
    with pytest.raises(ConfigError, match="backend must be 'c' or 'torch'"):
        pack(caches, layout, [0], chunk, backend="cuda")  # type: ignore[arg-type]
    if backend() == "c":
        with pytest.raises(ConfigError, match="num_threads must be >= 1, got 0"):
            pack(caches, layout, [0], chunk, num_threads=0)


def test_block_ids_as_tensor_and_array(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.CPU)
    layout = KVLayout.from_tensors(caches)
    chunks = [torch.zeros(layout.chunk_nbytes(3), dtype=torch.uint8) for _ in range(3)]
    pack(caches, layout, [5, 0, 1], chunks[0])
    pack(caches, layout, np.array([5, 0, 1]), chunks[1])
    pack(caches, layout, torch.tensor([5, 0, 1]), chunks[2])
    assert torch.equal(chunks[0], chunks[1]) and torch.equal(chunks[0], chunks[2])


@pytest.mark.parametrize("first,count", [(0, 2), (1, 2), (2, 2), (3, 1)])
def test_unpack_part_of_a_chunk(first: int, count: int) -> None:
    import torch

    from fabric.kv import KVLayout, pack, unpack

    torch.manual_seed(0)
    caches = [torch.randn(2, 16, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    layout = KVLayout.from_tensors(caches)
    src_ids = [5, 9, 2, 11]
    chunk = torch.empty(layout.chunk_nbytes(4), dtype=torch.uint8)
    pack(caches, layout, src_ids, chunk)
    target = [torch.zeros_like(c) for c in caches]
    dst_ids = [7, 3, 12, 0][:count]
    unpack(chunk, target, layout, dst_ids, chunk_blocks=4, first=first)
    for src, dst in zip(caches, target, strict=True):
        for pos, block in enumerate(dst_ids):
            assert torch.equal(dst[:, block], src[:, src_ids[first + pos]])
        untouched = [b for b in range(16) if b not in dst_ids]
        assert not dst[:, untouched].any()
