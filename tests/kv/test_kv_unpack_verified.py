"""unpack(..., checksum=, nbytes=): verified at use, fused with the copy, every layout."""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
import xxhash

from fabric.errors import ChecksumMismatch, LayoutError
from fabric.kv import KVLayout, LayoutKind, backend, pack, unpack
from fabric.kv import verify as kv_verify
from fabric.kv.pack import Backend
from fabric.store import ChunkStore, StoreConfig

MakeCaches = Callable[..., list[torch.Tensor]]
BACKENDS: list[Backend] = ["c", "torch"] if backend() == "c" else ["torch"]
KINDS = [LayoutKind.CPU, LayoutKind.FLASH, LayoutKind.MLA]
SRC_IDS = [7, 2, 3, 4, 0, 11]  # a run (2, 3, 4) among single blocks


@pytest.fixture(params=[1000, kv_verify.PIECE_BYTES], ids=["small-pieces", "default-pieces"])
def piece(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Pieces that cut copies mid-block (1000 B) and the shipped size."""
    monkeypatch.setattr(kv_verify, "PIECE_BYTES", request.param)
    return int(request.param)


def packed(caches: list[torch.Tensor], ids: list[int], spare: int = 4096) -> torch.Tensor:
    """A store slot holding the chunk of ``ids``, with ``spare`` bytes after it."""
    layout = KVLayout.from_tensors(caches)
    slot = torch.full((layout.chunk_nbytes(len(ids)) + spare,), 0x5A, dtype=torch.uint8)
    pack(caches, layout, ids, slot)
    return slot


def digest(slot: torch.Tensor, nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest(slot[:nbytes].numpy())


def plain_and_verified(
    caches: list[torch.Tensor],
    slot: torch.Tensor,
    dst_ids: list[int],
    use: Backend,
    nbytes: int,
    **kw: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The caches after a plain unpack and after a verified one."""
    layout = KVLayout.from_tensors(caches)
    plain = [torch.zeros_like(c) for c in caches]
    verified = [torch.zeros_like(c) for c in caches]
    unpack(slot, plain, layout, dst_ids, backend=use, **kw)
    checksum = digest(slot, nbytes)
    unpack(slot, verified, layout, dst_ids, backend=use, checksum=checksum, nbytes=nbytes, **kw)
    return plain, verified


def raw(tensors: list[torch.Tensor]) -> list[bytes]:
    return [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


@pytest.mark.parametrize("use", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("first", "count", "partial"),
    [(0, 6, False), (0, 4, True), (2, 3, False), (5, 1, False), (1, 2, True)],
    ids=["whole", "partial-chunk", "first=2", "last-block", "partial-first=1"],
)
def test_verified_unpack_equals_plain_unpack(
    make_caches: MakeCaches,
    piece: int,
    use: Backend,
    kind: LayoutKind,
    first: int,
    count: int,
    partial: bool,
) -> None:
    caches = make_caches(kind, num_blocks=16)
    layout = KVLayout.from_tensors(caches)
    chunk_ids = SRC_IDS[:4] if partial else SRC_IDS  # a prompt's last chunk is partial
    slot = packed(caches, chunk_ids)
    nbytes = layout.chunk_nbytes(len(chunk_ids))
    dst_ids = [9, 1, 2, 3, 15, 14][:count]
    kw = {"chunk_blocks": len(chunk_ids), "first": first}
    plain, verified = plain_and_verified(caches, slot, dst_ids, use, nbytes=nbytes, **kw)
    assert raw(verified) == raw(plain)
    for old, new in zip(caches, verified, strict=True):
        for pos, block in enumerate(dst_ids):
            got = new[:, block] if kind is LayoutKind.FLASH else new[block]
            want = (
                old[:, chunk_ids[first + pos]]
                if kind is LayoutKind.FLASH
                else old[chunk_ids[first + pos]]
            )
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("use", BACKENDS)
def test_verified_unpack_of_strided_blocks(piece: int, use: Backend) -> None:
    """K and V interleaved per block: blocks are not adjacent, copies are not coalesced."""
    gen = torch.Generator().manual_seed(5)
    caches = [torch.randn(12, 2, 4, 2, 8, generator=gen).transpose(0, 1) for _ in range(2)]
    layout = KVLayout.from_tensors(caches)
    slot = packed(caches, [1, 2, 3, 8])
    nbytes = layout.chunk_nbytes(4)
    plain, verified = plain_and_verified(caches, slot, [4, 5, 6, 0], use, nbytes=nbytes)
    assert raw(verified) == raw(plain)


@pytest.mark.parametrize("use", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["start", "copied", "not-copied", "last-byte", "past-chunk"])
def test_flipped_byte_anywhere_raises_after_the_copy(
    make_caches: MakeCaches, piece: int, use: Backend, kind: LayoutKind, where: str
) -> None:
    caches = make_caches(kind, num_blocks=16)
    layout = KVLayout.from_tensors(caches)
    slot = packed(caches, SRC_IDS)
    chunk = layout.chunk_nbytes(len(SRC_IDS))
    nbytes = chunk + 100  # the store's digest may cover more than the chunk
    checksum = digest(slot, nbytes)
    first, seg = 3, layout.segment_bytes
    at = {
        "start": 0,  # block 0 of layer 0: not copied with first=3
        "copied": (layout.segments * len(SRC_IDS) + first) * seg + 5,  # layer 1, block 3
        "not-copied": seg + 7,  # layer 0, block 1
        "last-byte": chunk - 1,
        "past-chunk": nbytes - 1,  # hashed, never copied
    }[where]
    slot[at] ^= 0x01
    target = [torch.zeros_like(c) for c in caches]
    with pytest.raises(ChecksumMismatch, match="garbage"):
        unpack(
            slot,
            target,
            layout,
            [8, 9, 10],
            backend=use,
            chunk_blocks=len(SRC_IDS),
            first=first,
            checksum=checksum,
            nbytes=nbytes,
        )
    # the copy happened before the check: the caller recomputes those blocks
    blocks = target[0][:, [8, 9, 10]] if kind is LayoutKind.FLASH else target[0][[8, 9, 10]]
    assert blocks.view(torch.uint8).any()


def test_streaming_digest_equals_the_one_shot_digest(piece: int) -> None:
    rng = np.random.default_rng(1)
    for nbytes in (0, 1, piece - 1, piece, piece + 1, 5 * piece + 17):
        data = rng.integers(0, 256, nbytes + 8, dtype=np.uint8)
        ends = np.asarray([nbytes // 2, nbytes] if nbytes else [], dtype=np.int64)
        copied: list[tuple[int, int]] = []
        got = kv_verify.hash_while_copying(data.data, nbytes, ends, _recorder(copied))
        assert got == xxhash.xxh3_64_intdigest(data[:nbytes])
        assert sum(b - a for a, b in copied) == len(ends)  # every copy, once


def _recorder(into: list[tuple[int, int]]) -> Callable[[int, int], None]:
    return lambda a, b: into.append((a, b))


def test_split_at_pieces_covers_every_byte_once(piece: int) -> None:
    offsets = np.asarray([0, piece - 3, 3 * piece, 5 * piece + 1], dtype=np.int64)
    lengths = np.asarray([10, 2 * piece + 3, piece, 1], dtype=np.int64)
    dst = np.asarray([10_000_000, 20_000_000, 30_000_000, 40_000_000], dtype=np.int64)
    lo, out, n = kv_verify.split_at_pieces(offsets, dst, lengths)
    assert n.sum() == lengths.sum() and (n > 0).all()
    assert ((lo // piece) == ((lo + n - 1) // piece)).all()  # each inside one piece
    assert (np.diff(lo) > 0).all()
    for start, length, d in zip(offsets, lengths, dst, strict=True):
        mine = (lo >= start) & (lo < start + length)
        assert (out[mine] - d == lo[mine] - start).all()


def test_bad_checksum_arguments(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.CPU)
    layout = KVLayout.from_tensors(caches)
    slot = packed(caches, [1, 2], spare=0)
    chunk = layout.chunk_nbytes(2)
    target = [torch.zeros_like(c) for c in caches]
    with pytest.raises(LayoutError, match="nbytes >= chunk"):
        unpack(slot, target, layout, [1, 2], checksum=1, nbytes=chunk - 1)
    with pytest.raises(LayoutError, match="nbytes >= chunk"):
        unpack(slot, target, layout, [1, 2], checksum=1, nbytes=chunk + 1)  # past the buffer
    with pytest.raises(LayoutError, match="give the checksum too"):
        unpack(slot, target, layout, [1, 2], nbytes=chunk)


@pytest.mark.parametrize("use", BACKENDS)
def test_store_gives_what_unpack_verifies(make_caches: MakeCaches, use: Backend) -> None:
    caches = make_caches(LayoutKind.FLASH, num_blocks=16)
    layout = KVLayout.from_tensors(caches)
    store = ChunkStore(StoreConfig(slot_bytes=layout.chunk_nbytes(8), num_slots=2))
    slot = store.allocate(b"k" * 16)
    nbytes = pack(caches, layout, SRC_IDS, store.pool.slot_view(slot))
    store.commit(slot, b"k" * 16, nbytes)
    found = store.slot_digest(slot)
    assert found is not None and found.nbytes == nbytes
    target = [torch.zeros_like(c) for c in caches]
    view = store.pool.slot_view(slot)
    kw = {"backend": use, "chunk_blocks": len(SRC_IDS), "first": 1}
    unpack(view, target, layout, [3, 4], checksum=found.checksum, nbytes=found.nbytes, **kw)
    view[0] ^= 0xFF  # a byte of block 0, which this unpack does not copy
    with pytest.raises(ChecksumMismatch):
        unpack(view, target, layout, [3, 4], checksum=found.checksum, nbytes=found.nbytes, **kw)


@pytest.mark.parametrize("stream", [-1, 0, 1])
def test_copy_batch_stream_modes_copy_exactly(stream: int) -> None:
    _copy = pytest.importorskip("fabric.kv._copy", reason="fabric.kv._copy is not built")

    rng = np.random.default_rng(stream + 2)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    # unaligned starts and odd lengths: the streaming path's head and tail
    starts = np.asarray([0, 4097, 70_001, 300_003], dtype=np.int64)
    lengths = np.asarray([4096, 65_535, 200_000, 700_001], dtype=np.int64)
    _copy.copy_batch(dst.ctypes.data + starts, src.ctypes.data + starts, lengths, 1, stream=stream)
    for start, n in zip(starts, lengths, strict=True):
        assert (dst[start : start + n] == src[start : start + n]).all()
    mask = np.ones(len(src), dtype=bool)
    for start, n in zip(starts, lengths, strict=True):
        mask[start : start + n] = False
    assert not dst[mask].any()


def test_verified_unpack_works_with_a_copy_kernel_built_before_stream(
    make_caches: MakeCaches, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = pytest.importorskip("fabric.kv._copy", reason="fabric.kv._copy is not built")
    pack_module = sys.modules["fabric.kv.pack"]

    class OldBuild:
        @staticmethod
        def copy_batch(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, threads: int) -> None:
            real.copy_batch(dst, src, lengths, threads)

    monkeypatch.setattr(pack_module, "_copy", OldBuild)
    pack_module._stream_kwargs.cache_clear()
    try:
        caches = make_caches(LayoutKind.CPU)
        layout = KVLayout.from_tensors(caches)
        slot = packed(caches, [3, 1])
        nbytes = layout.chunk_nbytes(2)
        plain, verified = plain_and_verified(caches, slot, [5, 6], "c", nbytes=nbytes)
        assert raw(verified) == raw(plain)
        assert pack_module._stream_kwargs() == {}
    finally:
        pack_module._stream_kwargs.cache_clear()
