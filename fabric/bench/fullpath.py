"""fabric's full path, sending side: pack, checksum, reserve, write, pipelined.

::

    packer thread  | pack b0 | pack b1      | pack b2      | ...
    main thread    | Reserve | WRITE b0 ... | WRITE b1 ... | WRITE b2 | wait
                               (UCX's cma copy runs inside NIXL's transfer(),
                                with the GIL released)

``b0, b1, ..`` are batches of ``batch`` chunks; each batch is one WRITE with
one notification. "pack" is fabric's ``pack`` into a store slot and the
store's ``commit`` (which hashes the chunk). The receiving side is
:meth:`fabric.bench.transfer_side.BenchSide.unpack_as_landed`: it unpacks a
chunk as soon as it lands while the server's verifier hashes it.

``fused_checksum`` (off by default) packs a chunk a few layers at a time and
hashes each piece while it is still in cache (streaming xxh3 over the pieces
equals the store's one-shot xxh3), so the checksum costs no second pass over
memory. NOTE: measured here it costs more than it saves: every ``pack`` call
re-validates the cache layout and builds its copy plan, and 32 calls per
chunk (one per layer of Llama-3-8B at 256 tokens) added ~50 ms of CPU per
256 MiB where the separate hash took ~12. A ``pack`` that hashed as it
copied (in ``fabric.kv._copy``) would get the saving without the calls.

NOTE: this is a benchmark-side arrangement of fabric's public API (``pack``,
``ChunkStore.commit``, ``PeerLink.reserve/write``), nothing the connector
could not do the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import xxhash
from pydantic import model_validator

from fabric.kv import KVLayout, pack
from fabric.kv.pack import settle
from fabric.settings import Settings

if TYPE_CHECKING:
    import numpy as np

    from fabric.bench.transfer_side import BenchSide
    from fabric.transfer.client import PeerLink, PendingPush

PIECE_BYTES = 1 << 20  # NOTE: about one core's L2 here (1 MiB of 2 MiB over 2 cores)


class FullPathOptions(Settings):
    """How the full path runs; recorded with every result.

    ``pipeline``: pack on a worker thread while the main thread writes.
    ``fused_checksum``: hash each packed piece while cached (else the store
    hashes the whole chunk after packing). ``unpack_when``: the receiver
    unpacks a chunk once ``landed`` (verified alongside) or ``verified``.
    """

    pipeline: bool = True
    fused_checksum: bool = False
    pack_threads: int = 1
    unpack_when: str = "landed"
    unpack_threads: int = 1
    piece_bytes: int = PIECE_BYTES

    @model_validator(mode="after")
    def _check(self) -> FullPathOptions:
        if self.unpack_when not in ("landed", "verified"):
            raise ValueError(f"unpack_when: {self.unpack_when!r} (landed, verified)")
        if self.pack_threads < 1 or self.unpack_threads < 1 or self.piece_bytes < 1:
            raise ValueError("pack_threads, unpack_threads and piece_bytes must be >= 1")
        return self


def layer_groups(layout: KVLayout, num_blocks: int, piece_bytes: int) -> list[tuple[int, int]]:
    """(first layer, layer count) pieces of a chunk of ``num_blocks`` blocks.

    Each piece is a contiguous byte range of the chunk (the format is
    layer-major) of about ``piece_bytes``, at least one layer.
    """
    per_layer = layout.segments * num_blocks * layout.segment_bytes
    step = max(1, piece_bytes // per_layer)
    return [
        (first, min(step, layout.num_layers - first)) for first in range(0, layout.num_layers, step)
    ]


class ChunkPacker:
    """Packs chunks of a :class:`BenchSide` into its store and commits them."""

    def __init__(self, side: BenchSide, options: FullPathOptions) -> None:
        self.side, self.options = side, options
        self._sublayouts: dict[int, KVLayout] = {}

    def pack_batch(self, keys: Sequence[bytes], indices: Sequence[int]) -> list[int]:
        """Pack and commit chunks ``indices``; their store slots, in order."""
        return [self.pack_chunk(keys[i], i) for i in indices]

    def pack_chunk(self, key: bytes, index: int) -> int:
        side, end = self.side, self.side.end
        ids = side.chunk_block_ids(end.chunk_blocks, index)
        slot = end.store.allocate(key)
        dst = end.store.pool.slot_view(slot)
        if self.options.fused_checksum and end.store.pool.is_host:  # NOTE: xxh3, host pools
            nbytes, digest = self.pack_hashed(ids, dst)
            end.store.commit(slot, key, nbytes, digest)
        else:
            nbytes = pack(side.views, side.layout, ids, dst, num_threads=self.options.pack_threads)
            settle(dst.device)  # NOTE: a VRAM slot: the copies end before commit hashes it
            end.store.commit(slot, key, nbytes)
        return slot

    def pack_hashed(self, ids: np.ndarray, dst: object) -> tuple[int, int]:
        """Pack ``ids`` into ``dst`` piece by piece, hashing each piece; (bytes, xxh3)."""
        side = self.side
        layout = side.layout
        per_layer = layout.segments * len(ids) * layout.segment_bytes
        state = xxhash.xxh3_64()
        for first, count in layer_groups(layout, len(ids), self.options.piece_bytes):
            piece = dst.narrow(0, first * per_layer, count * per_layer)  # type: ignore[attr-defined]
            views = side.views[first : first + count]
            pack(views, self._sublayout(count), ids, piece, num_threads=self.options.pack_threads)
            state.update(piece.numpy())
        return len(ids) * layout.block_bytes, state.intdigest()

    def _sublayout(self, num_layers: int) -> KVLayout:
        sub = self._sublayouts.get(num_layers)
        if sub is None:
            sub = dataclasses.replace(self.side.layout, num_layers=num_layers)
            self._sublayouts[num_layers] = sub
        return sub


class FullPathSender:
    """Runs the sending half of fabric's full path for one :class:`BenchSide`."""

    def __init__(self, side: BenchSide, options: FullPathOptions) -> None:
        self.side, self.options = side, options
        self.packer = ChunkPacker(side, options)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="bench-pack")

    def run(self, link: PeerLink, rid: str, keys: Sequence[bytes], batch: int) -> None:
        """Reserve ``keys`` (chunks ``0 .. len(keys) - 1``), pack and write them."""
        side, end = self.side, self.side.end
        batches = [range(s, min(s + batch, len(keys))) for s in range(0, len(keys), batch)]
        futures: list[Future[list[int]]] = []
        if self.options.pipeline:
            futures = [self._pool.submit(self.packer.pack_batch, keys, b) for b in batches]
        nbytes = [
            side.layout.chunk_nbytes(len(side.chunk_block_ids(end.chunk_blocks, i)))
            for i in range(len(keys))
        ]
        res = link.reserve(rid, keys, nbytes)
        pending: list[PendingPush] = []
        for n, indices in enumerate(batches):
            slots = futures[n].result() if futures else self.packer.pack_batch(keys, indices)
            pending.append(link.write(res, indices, slots))
            pending = [p for p in pending if not p.done()]
        for push in pending:
            push.wait(120)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
