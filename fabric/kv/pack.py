"""Copy blocks of a paged KV cache into a chunk buffer and back.

``pack`` gathers the blocks ``block_ids`` of every layer into a contiguous
chunk in the byte format drawn in :mod:`fabric.kv.layout`; ``unpack`` scatters
a chunk back into the cache. Block ids may be unordered and non-contiguous;
position ``j`` of ``block_ids`` is block ``j`` of the chunk.

CPU tensors (the point of this module: torch's CPU ``index_select`` manages
~1.6 GB/s where memcpy does ~13):

    block_ids --numpy--> runs of consecutive ids --numpy--> (dst, src, nbytes)
        --> fabric.kv._copy.copy_batch: copy each with the GIL released, on
            DEFAULT_NUM_THREADS threads, streaming stores for large batches

If the C extension was not built, a Python loop of torch slice ``copy_`` calls
does the same copies (correct, slower) and a warning is logged once;
:func:`backend` says which one runs. Tensors on an accelerator go to
:class:`DeviceKernels` chosen per device type: the fused kernels of ``fabric/kv/csrc/``
for CUDA when they load (:mod:`fabric.kv.cuda`), else torch indexing.

``unpack(..., checksum=, nbytes=)`` verifies the chunk at use, fused with the
copy so it costs no extra pass over memory (:mod:`fabric.kv.verify`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import numpy as np
import xxhash

from fabric.errors import ChecksumMismatch, ConfigError, LayoutError
from fabric.kv import verify as kv_verify
from fabric.kv.cuda import kernels_for
from fabric.kv.fold64 import fold64
from fabric.kv.layout import KVLayout, LayoutKind, SegmentTable, named_layers, segment_table
from fabric.kv.verify import hash_range_while_copying, hash_while_copying, split_at_pieces

if TYPE_CHECKING:
    import torch

    from fabric.kv.kernels import DeviceKernels
    from fabric.kv.layout import KVCaches

    BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def _load_copy() -> ModuleType | None:
    """The C extension, or None when it was not built."""
    try:
        return importlib.import_module("fabric.kv._copy")
    except ImportError:
        return None


_copy = _load_copy()

log = logging.getLogger(__name__)

ChecksumKind = Literal["xxh3", "fold64"]
Backend = Literal["c", "torch"]

# NOTE: chosen by measurement on the 2-core dev VM (the benchmarks/pack.py
# workload, 512 MiB per op, 31 alternating reps): 2 threads vs 1 gave pack
# 17.3 vs 15.3 GB/s (CPU layout) and 12.6 vs 9.1 (flash), unpack 17.7 vs 15.1
# and 15.0 vs 11.6; torch's 2-thread copy_ did 14-15. The C side starts at
# most one thread per MiB of the batch, so small chunks stay on one thread.
DEFAULT_NUM_THREADS = min(2, os.cpu_count() or 1)


FUSED_MIN_COPY_BYTES = 128 << 10
"""Below this mean copy size, ``pack_checksummed`` packs and then hashes: one
hash call per copy costs more than the pass it saves. Measured on the 2-core
dev VM (``benchmarks/pack.py --checksum``, Llama-3-8B geometry, 33 alternating
reps): the CPU layout's 512 KiB copies 0.85x the time of pack-then-hash
(interval 0.83-0.85); the flash layout's 32 KiB ones 1.10x (1.07-1.18) in a
first run, 0.94x (0.92-0.98) in a second: not settled (NOTE: remeasure)."""


def backend() -> Backend:
    """The CPU copy backend in use: ``"c"`` (fabric.kv._copy) or ``"torch"``."""
    return "c" if _copy is not None else "torch"


def pack(
    kv_caches: KVCaches,
    layout: KVLayout,
    block_ids: BlockIds,
    dst: torch.Tensor,
    *,
    backend: Backend | None = None,
    num_threads: int | None = None,
) -> int:
    """Gather blocks ``block_ids`` of every layer into the chunk buffer ``dst``.

    ``dst`` is a contiguous 1-D uint8 tensor of at least
    ``layout.chunk_nbytes(len(block_ids))`` bytes. Returns the bytes written.
    ``backend`` and ``num_threads`` override the CPU copy backend and thread
    count (defaults: :func:`backend`, ``DEFAULT_NUM_THREADS``).
    """
    ids = _block_ids(block_ids, layout)
    device = named_layers(kv_caches)[0][1].device
    nbytes = _check_buffer(dst, layout, len(ids), "dst", device)
    if device.type != "cpu":
        views = segment_views(kv_caches, layout)
        device_kernels(device.type).pack(views, ids, dst[:nbytes])
    elif _resolve(backend) == "c":
        _copy_c(kv_caches, layout, ids, dst, into_chunk=True, num_threads=num_threads)
    else:
        _pack_torch(segment_views(kv_caches, layout), _runs(ids, coalesce=True), dst, layout)
    return nbytes


def pack_checksummed(
    kv_caches: KVCaches,
    layout: KVLayout,
    block_ids: BlockIds,
    dst: torch.Tensor,
) -> tuple[int, int | None]:
    """:func:`pack`, and the xxh3-64 of the bytes written: (nbytes, checksum).

    On the C backend the checksum costs no pass of its own: the cache's
    bytes are copied in pieces of :data:`~fabric.kv.verify.PIECE_BYTES` (in
    chunk order, one thread, streaming stores), and each piece's source bytes
    are hashed right after the copy read them, from cache. A source rewritten
    between a piece's copy and its hash gives a checksum the written bytes do
    not match: every reader verifies, so the chunk fails at use (and stays so
    in this store until evicted); one rewritten before its copy is not seen,
    as with pack-then-hash (the hook order keeps writers out). Elsewhere (an
    accelerator, the torch fallback) the checksum is None: the caller hashes
    ``dst``. Copies shorter than ``FUSED_MIN_COPY_BYTES`` on average are
    packed, then hashed.
    """
    ids = _block_ids(block_ids, layout)
    device = named_layers(kv_caches)[0][1].device
    if device.type != "cpu" or backend() != "c":
        return pack(kv_caches, layout, ids, dst), None
    nbytes = _check_buffer(dst, layout, len(ids), "dst", device)
    offsets, cache, lengths = copy_plan(kv_caches, layout, ids, 0)
    if lengths.size and lengths.mean() < FUSED_MIN_COPY_BYTES:
        assert _copy is not None
        _copy.copy_batch(offsets + dst.data_ptr(), cache, lengths, 1)
        return nbytes, xxhash.xxh3_64_intdigest(dst[:nbytes].numpy().data)
    return nbytes, _pack_hashed_c(dst, nbytes, offsets, cache, lengths)


def _pack_hashed_c(
    dst: torch.Tensor, nbytes: int, offsets: np.ndarray, cache: np.ndarray, lengths: np.ndarray
) -> int:
    """Copy with fabric.kv._copy piece by piece, hashing each piece's source
    (``offsets`` in the chunk, ``cache`` addresses, ``lengths``: :func:`copy_plan`)."""
    if int(lengths.sum()) != nbytes:
        raise LayoutError("pack: the copies do not tile the chunk in order")  # NOTE: a bug
    hasher = xxhash.xxh3_64()
    copy_hashing(dst.data_ptr(), offsets, cache, lengths, hasher)
    return hasher.intdigest()


def copy_hashing(
    base: int, offsets: np.ndarray, cache: np.ndarray, lengths: np.ndarray, hasher: xxhash.xxh3_64
) -> None:
    """Copy ``lengths`` bytes from ``cache`` addresses to ``base + offsets``
    (ascending, back to back: part of a :func:`copy_plan`) piece by piece,
    feeding each piece's source bytes to ``hasher`` right after the copy read them."""
    assert _copy is not None
    copy_batch, stream = _copy.copy_batch, _stream_kwargs()
    offsets, cache, lengths = split_at_pieces(offsets, cache, lengths)
    if len(offsets) > 1 and (offsets[1:] != offsets[:-1] + lengths[:-1]).any():
        raise LayoutError("pack: the copies do not tile the chunk in order")  # NOTE: a bug
    starts = offsets + base
    pieces = offsets // kv_verify.PIECE_BYTES
    cuts = [0, *(np.flatnonzero(np.diff(pieces)) + 1).tolist(), len(offsets)]
    sources, sizes = cache.tolist(), lengths.tolist()
    for a, b in itertools.pairwise(cuts):
        copy_batch(starts[a:b], cache[a:b], lengths[a:b], 1, **stream)
        for addr, size in zip(sources[a:b], sizes[a:b], strict=True):
            hasher.update((ctypes.c_char * size).from_address(addr))


def copy_to_chunk(base: int, offsets: np.ndarray, cache: np.ndarray, lengths: np.ndarray) -> None:
    """Copy ``lengths`` bytes from ``cache`` addresses to ``base + offsets``, one thread."""
    assert _copy is not None
    _copy.copy_batch(offsets + base, cache, lengths, 1)


def unpack(
    src: torch.Tensor,
    kv_caches: KVCaches,
    layout: KVLayout,
    block_ids: BlockIds,
    *,
    backend: Backend | None = None,
    num_threads: int | None = None,
    chunk_blocks: int | None = None,
    first: int = 0,
    checksum: int | None = None,
    nbytes: int | None = None,
    checksum_kind: ChecksumKind = "xxh3",
) -> int:
    """Scatter the chunk in ``src`` into blocks ``block_ids`` of every layer.

    The inverse of :func:`pack`; ``block_ids`` must not repeat. Returns the
    bytes of the chunk copied. To unpack only part of a chunk, give the
    chunk's block count ``chunk_blocks``: ``block_ids`` then receive the
    chunk's blocks ``first .. first + len(block_ids) - 1`` (the rest stay
    untouched).

    With ``checksum`` (the xxh3-64 of the first ``nbytes`` bytes of ``src``;
    ``nbytes`` defaults to the whole chunk, and must cover it) the bytes are
    verified as they are copied, every one of them, also those a partial
    unpack does not copy. On a mismatch ChecksumMismatch is raised after
    the copy: the blocks written hold garbage and must be recomputed. The
    hash is sequential, so a verified unpack copies on one thread
    (``num_threads`` is not used). A cache on an accelerator is verified in
    a pass of its own before it is unpacked (``src`` in host memory).
    ``checksum_kind`` is the checksum's algorithm, the pool's
    (:attr:`~fabric.store.pool.ChunkPool.checksum_name`): ``fold64`` (a VRAM
    pool's, :mod:`fabric.kv.fold64`) is computed where ``src`` is (host or
    the cache's device) in a pass before the copy, and a chunk that fails is
    then not copied at all. On an accelerator the copy has ended when this
    returns (``src`` may be reused at once).
    """
    if checksum is not None:
        if checksum_kind == "fold64":
            return _unpack_fold64(
                src, kv_caches, layout, block_ids, chunk_blocks, first, checksum, nbytes
            )
        if checksum_kind != "xxh3":
            raise LayoutError(f"unpack: unknown checksum_kind {checksum_kind!r}")
        return _unpack_verified(
            src, kv_caches, layout, block_ids, backend, chunk_blocks, first, checksum, nbytes
        )
    if nbytes is not None:
        raise LayoutError("unpack: nbytes is the span a checksum covers; give the checksum too")
    if chunk_blocks is not None and (first, len(block_ids)) != (0, chunk_blocks):
        src = _chunk_part(src, layout, chunk_blocks, first, len(block_ids))
    ids = _unique_block_ids(block_ids, layout)
    device = named_layers(kv_caches)[0][1].device
    nbytes = _check_buffer(src, layout, len(ids), "src", device)
    if device.type != "cpu":
        views = segment_views(kv_caches, layout)
        kernels = device_kernels(device.type)
        kernels.unpack(src[:nbytes], views, ids)
        # NOTE: the copy runs on a stream and ``src`` is a pool slot that is
        # released (and may be written by the next NIXL WRITE, outside any
        # stream order) once this returns: wait until the copy has read it
        _wait_for(kernels, device)
    elif _resolve(backend) == "c":
        _copy_c(kv_caches, layout, ids, src, into_chunk=False, num_threads=num_threads)
    else:
        _unpack_torch(src, segment_views(kv_caches, layout), _runs(ids, coalesce=True), layout)
    return nbytes


def _unpack_verified(
    src: torch.Tensor,
    kv_caches: KVCaches,
    layout: KVLayout,
    block_ids: BlockIds,
    backend: Backend | None,
    chunk_blocks: int | None,
    first: int,
    checksum: int,
    nbytes: int | None,
) -> int:
    """``unpack`` that hashes the first ``nbytes`` of ``src`` as it copies."""
    ids = _unique_block_ids(block_ids, layout)
    blocks = len(ids) if chunk_blocks is None else chunk_blocks
    device = named_layers(kv_caches)[0][1].device
    hashed = verified_span(src, layout, len(ids), blocks, first, nbytes, device)[1]
    if device.type != "cpu":
        actual = xxhash.xxh3_64_intdigest(src[:hashed].numpy().data)
        unpack(src, kv_caches, layout, ids, chunk_blocks=chunk_blocks, first=first)
    elif _resolve(backend) == "c":
        actual = _unpack_hashed_c(src, hashed, kv_caches, layout, ids, blocks, first)
    else:
        actual = _unpack_hashed_torch(src, hashed, kv_caches, layout, ids, blocks, first)
    if actual != checksum:
        raise ChecksumMismatch(
            f"chunk bytes hash to {actual:#018x} over {hashed} bytes, expected "
            f"{checksum:#018x}: the {len(ids)} block(s) unpacked hold garbage"
        )
    return layout.chunk_nbytes(len(ids))


def _unpack_fold64(
    src: torch.Tensor,
    kv_caches: KVCaches,
    layout: KVLayout,
    block_ids: BlockIds,
    chunk_blocks: int | None,
    first: int,
    checksum: int,
    nbytes: int | None,
) -> int:
    """``unpack`` of a chunk whose checksum is fold64 (a VRAM pool's): hashed
    where it is, before any of it is copied (a chunk that fails is not)."""
    ids = _unique_block_ids(block_ids, layout)
    blocks = len(ids) if chunk_blocks is None else chunk_blocks
    device = named_layers(kv_caches)[0][1].device
    hashed = verified_span(src, layout, len(ids), blocks, first, nbytes, device, True)[1]
    actual = fold64(src[:hashed])
    if actual != checksum:
        raise ChecksumMismatch(
            f"chunk bytes fold to {actual:#018x} over {hashed} bytes, expected "
            f"{checksum:#018x}: nothing was unpacked"
        )
    unpack(src, kv_caches, layout, ids, chunk_blocks=chunk_blocks, first=first)
    return layout.chunk_nbytes(len(ids))


def verified_span(
    src: torch.Tensor,
    layout: KVLayout,
    count: int,
    blocks: int,
    first: int,
    nbytes: int | None,
    device: torch.device,
    on_device: bool = False,
) -> tuple[int, int]:
    """(chunk bytes, bytes hashed) of a verified unpack of ``count`` blocks
    from ``first`` of the ``blocks``-block chunk in ``src``, whose checksum
    covers its first ``nbytes`` (None: the chunk); LayoutError unless they fit
    in host memory (``on_device``: or in the cache's device memory)."""
    _check_part(blocks, first, count)
    covered = _check_buffer(src, layout, blocks, "src", device)
    hashed = covered if nbytes is None else nbytes
    where_ok = src.device.type == "cpu" or (on_device and src.device == device)
    if not covered <= hashed <= src.numel() or not where_ok:
        raise LayoutError(
            f"checksum over {hashed} bytes of a {src.numel()}-byte {src.device} buffer "
            f"cannot verify a chunk of {covered} bytes (host memory, nbytes >= chunk)"
        )
    return covered, hashed


def _unpack_hashed_c(
    src: torch.Tensor,
    hashed: int,
    kv_caches: KVCaches,
    layout: KVLayout,
    ids: np.ndarray,
    blocks: int,
    first: int,
) -> int:
    """Copy with fabric.kv._copy, piece by piece as ``src[:hashed]`` is hashed."""
    hasher = xxhash.xxh3_64()
    plan = unpack_rows(kv_caches, layout, ids, blocks, first)
    unpack_hashing(src, hasher, (0, hashed), *(a.ravel() for a in plan))
    return hasher.intdigest()


def unpack_rows(
    kv_caches: KVCaches, layout: KVLayout, ids: np.ndarray, blocks: int, first: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk offsets, cache addresses, byte counts) of unpacking blocks
    ``first ..`` of a chunk of ``blocks`` into ``ids``: one row per (layer,
    segment) in chunk order, one column per run of consecutive ids."""
    table = segment_table(kv_caches, layout)
    runs = _runs(ids, coalesce=table.blocks_adjacent)
    seg, rows = table.segment_bytes, np.arange(len(table.bases), dtype=np.int64)[:, None]
    offsets = (rows * blocks + first + runs.chunk_pos) * seg
    cache = table.bases[:, None] + runs.start * table.block_strides[:, None]
    return offsets, cache, np.broadcast_to(runs.length * seg, offsets.shape)


def unpack_hashing(
    src: torch.Tensor,
    hasher: xxhash.xxh3_64,
    span: tuple[int, int],
    offsets: np.ndarray,
    cache: np.ndarray,
    lengths: np.ndarray,
) -> None:
    """Feed ``src``'s bytes ``span`` to ``hasher`` and make the copies of
    :func:`unpack_rows` (flat, inside ``span``) piece by piece as they are
    hashed, with fabric.kv._copy."""
    assert _copy is not None
    copy_batch, stream = _copy.copy_batch, _stream_kwargs()
    offsets, cache, lengths = split_at_pieces(offsets, cache, lengths)
    starts = offsets + src.data_ptr()

    def copy(a: int, b: int) -> None:
        # NOTE: one thread, as a piece is far below what a second one pays
        # for; streaming stores, as the destination is not read soon and a
        # plain store would first read it (as much memory traffic as a second
        # pass over the chunk).
        copy_batch(cache[a:b], starts[a:b], lengths[a:b], 1, **stream)

    hash_range_while_copying(src.numpy().data, hasher, *span, offsets + lengths, copy)


def _unpack_hashed_torch(
    src: torch.Tensor,
    hashed: int,
    kv_caches: KVCaches,
    layout: KVLayout,
    ids: np.ndarray,
    blocks: int,
    first: int,
) -> int:
    """The torch fallback: copy each run once all its bytes are hashed."""
    _warn_fallback()
    views = segment_views(kv_caches, layout)
    chunk = _chunk_view(src, layout, blocks)
    copies = [(row, run) for row in range(len(views)) for run in _run_tuples(_runs(ids, True))]
    ends = np.asarray(
        [(row * blocks + first + pos + n) * layout.segment_bytes for row, (_, pos, n) in copies],
        dtype=np.int64,
    )

    def copy(a: int, b: int) -> None:
        for row, (start, pos, n) in copies[a:b]:
            views[row][start : start + n].copy_(chunk[row, first + pos : first + pos + n])

    return hash_while_copying(src.numpy().data, hashed, ends, copy)


@dataclass(frozen=True)
class BlockRuns:
    """Runs of consecutive block ids: run ``r`` is cache blocks
    ``start[r] .. start[r] + length[r] - 1`` at chunk positions
    ``chunk_pos[r] ..``."""

    start: np.ndarray  # int64
    chunk_pos: np.ndarray  # int64
    length: np.ndarray  # int64
    num_blocks: int  # blocks in the chunk


def _runs(ids: np.ndarray, coalesce: bool) -> BlockRuns:
    """Split ``ids`` into runs of consecutive ids (or single blocks)."""
    if coalesce and len(ids):
        chunk_pos = np.flatnonzero(np.diff(ids, prepend=ids[0] - 2) != 1)
    else:
        chunk_pos = np.arange(len(ids), dtype=np.int64)
    length = np.diff(chunk_pos, append=len(ids))
    return BlockRuns(ids[chunk_pos], chunk_pos.astype(np.int64), length, len(ids))


def copy_plan(
    kv_caches: KVCaches, layout: KVLayout, ids: np.ndarray, chunk_addr: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk addresses, cache addresses, byte counts), one per segment and run.

    Consecutive block ids are one copy when blocks are back to back in memory.
    """
    return table_plan(segment_table(kv_caches, layout), ids, chunk_addr)


def table_plan(
    table: SegmentTable, ids: np.ndarray, chunk_addr: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`copy_plan` of a cache described by ``table`` (ids already checked)."""
    runs = _runs(ids, coalesce=table.blocks_adjacent)
    seg, rows = table.segment_bytes, np.arange(len(table.bases), dtype=np.int64)[:, None]
    chunk = chunk_addr + (rows * runs.num_blocks + runs.chunk_pos) * seg
    cache = table.bases[:, None] + runs.start * table.block_strides[:, None]
    lengths = np.broadcast_to(runs.length * seg, chunk.shape)
    return chunk.ravel(), cache.ravel(), np.ascontiguousarray(lengths).ravel()


def _copy_c(
    kv_caches: KVCaches,
    layout: KVLayout,
    ids: np.ndarray,
    buffer: torch.Tensor,
    *,
    into_chunk: bool,
    num_threads: int | None,
) -> None:
    assert _copy is not None
    chunk, cache, lengths = copy_plan(kv_caches, layout, ids, buffer.data_ptr())
    dst, src = (chunk, cache) if into_chunk else (cache, chunk)
    threads = DEFAULT_NUM_THREADS if num_threads is None else num_threads
    if threads < 1:
        raise ConfigError(f"num_threads must be >= 1, got {threads}")
    _copy.copy_batch(dst, src, lengths, threads)


def segment_views(kv_caches: KVCaches, layout: KVLayout) -> list[torch.Tensor]:
    """One uint8 ``[num_blocks, segment_bytes]`` view per (layer, segment) row."""
    import torch

    segment_table(kv_caches, layout)  # validates every tensor against layout
    views = []
    for _, tensor in named_layers(kv_caches):
        parts = [tensor[0], tensor[1]] if layout.kind is LayoutKind.FLASH else [tensor]
        views += [p.view(layout.num_blocks, -1).view(torch.uint8) for p in parts]
    return views


def _pack_torch(
    views: list[torch.Tensor], runs: BlockRuns, dst: torch.Tensor, layout: KVLayout
) -> None:
    _warn_fallback()
    chunk = _chunk_view(dst, layout, runs.num_blocks)
    for row, view in zip(chunk, views, strict=True):
        for start, pos, length in _run_tuples(runs):
            row[pos : pos + length].copy_(view[start : start + length])


def _unpack_torch(
    src: torch.Tensor, views: list[torch.Tensor], runs: BlockRuns, layout: KVLayout
) -> None:
    _warn_fallback()
    chunk = _chunk_view(src, layout, runs.num_blocks)
    for row, view in zip(chunk, views, strict=True):
        for start, pos, length in _run_tuples(runs):
            view[start : start + length].copy_(row[pos : pos + length])


def _chunk_part(
    src: torch.Tensor, layout: KVLayout, chunk_blocks: int, first: int, count: int
) -> torch.Tensor:
    """A contiguous chunk of blocks ``first .. first + count - 1`` of ``src``."""
    _check_part(chunk_blocks, first, count)
    _check_buffer(src, layout, chunk_blocks, "src", src.device)
    part = _chunk_view(src, layout, chunk_blocks)[:, first : first + count]
    return part.contiguous().view(-1)


def _check_part(chunk_blocks: int, first: int, count: int) -> None:
    if first < 0 or count < 1 or first + count > chunk_blocks:
        raise LayoutError(
            f"blocks {first}..{first + count - 1} are not inside a chunk of {chunk_blocks}"
        )


def _unique_block_ids(block_ids: BlockIds, layout: KVLayout) -> np.ndarray:
    ids = _block_ids(block_ids, layout)
    if len(np.unique(ids)) != len(ids):
        raise LayoutError("unpack block_ids repeat a block; each block can be written once")
    return ids


def _run_tuples(runs: BlockRuns) -> list[tuple[int, int, int]]:
    return list(
        zip(runs.start.tolist(), runs.chunk_pos.tolist(), runs.length.tolist(), strict=True)
    )


def _chunk_view(buffer: torch.Tensor, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """``buffer`` as ``[layers * segments, num_blocks, segment_bytes]``."""
    rows = layout.num_layers * layout.segments
    nbytes = layout.chunk_nbytes(num_blocks)
    return buffer[:nbytes].view(rows, num_blocks, layout.segment_bytes)


def settle(device: torch.device) -> None:
    """Block until this thread's pack/unpack copies on ``device`` have ended
    (nothing to wait for on the CPU, whose copies are synchronous). What a
    pack into a VRAM slot needs before anything reads the slot outside
    stream order: a checksum on a stream of its own, a NIXL WRITE."""
    if device.type != "cpu":
        _wait_for(device_kernels(device.type), device)


def _wait_for(kernels: DeviceKernels, device: torch.device) -> None:
    """Block until ``kernels``' latest copy on ``device`` has ended: its own
    event when it keeps one (the fused kernels' side stream), else the
    current stream, on which torch indexing ran."""
    import torch

    synchronize = getattr(kernels, "synchronize", None)
    if synchronize is not None:
        synchronize()
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "current_stream"):
        module.current_stream(device).synchronize()


def device_kernels(device_type: str) -> DeviceKernels:
    """The pack/unpack implementation for caches on ``device_type``.

    CUDA caches get the fused ``fabric/kv/csrc/`` kernels when the extension loads, any
    other accelerator (or CUDA without it) torch indexing: see :mod:`fabric.kv.cuda`.
    """
    return kernels_for(device_type)


def _block_ids(block_ids: BlockIds, layout: KVLayout) -> np.ndarray:
    """``block_ids`` as a 1-D int64 array, every id checked against the pool."""
    if hasattr(block_ids, "detach"):  # a torch tensor, without importing torch
        block_ids = block_ids.detach().cpu().numpy()
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise LayoutError(f"block_ids must be a 1-D sequence of ints, got {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int64, copy=False)
    bad = np.flatnonzero((ids < 0) | (ids >= layout.num_blocks))
    if bad.size:
        raise LayoutError(
            f"block id {ids[bad[0]]} (position {bad[0]}) out of range [0, {layout.num_blocks})"
        )
    return ids


def _check_buffer(
    buffer: torch.Tensor, layout: KVLayout, num_blocks: int, name: str, device: torch.device
) -> int:
    """Check ``buffer`` can hold a chunk of ``num_blocks`` blocks; return its bytes."""
    nbytes = layout.chunk_nbytes(num_blocks)
    if device.type == "cpu" and buffer.device.type != "cpu":
        raise LayoutError(f"{name} is on {buffer.device} but the KV cache is on the CPU")
    import torch

    if buffer.dim() != 1 or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise LayoutError(f"{name} must be a contiguous 1-D uint8 tensor")
    if buffer.numel() < nbytes:
        raise LayoutError(
            f"{name} holds {buffer.numel()} bytes, a chunk of {num_blocks} blocks needs {nbytes}"
        )
    return nbytes


def _resolve(requested: Backend | None) -> Backend:
    if requested is None:
        return backend()
    if requested == "c" and _copy is None:
        raise ConfigError("backend 'c' requested but fabric.kv._copy is not built")
    if requested not in ("c", "torch"):
        raise ConfigError(f"backend must be 'c' or 'torch', got {requested!r}")
    return requested


@functools.cache
def _stream_kwargs() -> dict[str, int]:
    """``stream=1`` for copy_batch, if the extension was built with it (older builds were not)."""
    assert _copy is not None
    empty = np.zeros(0, dtype=np.int64)
    try:
        _copy.copy_batch(empty, empty, empty, 1, stream=1)
    except TypeError:
        log.warning("fabric.kv._copy predates stream=; rebuild it for a faster verified unpack")
        return {}
    return {"stream": 1}


@functools.cache
def _warn_fallback() -> None:
    if _copy is None:
        log.warning("fabric.kv._copy is not built; packing KV with slower torch copies")
