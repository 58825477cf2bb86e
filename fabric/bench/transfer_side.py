"""One side of the transfer benchmark: a paged KV cache, raw NIXL and fabric.

Both processes of ``fabric.bench.transfer`` build a :class:`BenchSide`: the
cache and a raw NIXL agent live as long as the process; fabric's store and
transfer node (:class:`FabricEnd`) are rebuilt per chunk size and transport,
since a store's slot size is fixed. The receiver (``python -m
fabric.bench.transfer_side ARGS_JSON``) answers one JSON line per command:

    fabric TRANSPORT CHUNK_TOKENS   rebuild the store and node; its endpoint
    raw N                 wait for N raw-NIXL notifications
    direct-peer DESC MAP IDS
                          load the sender's data plane (DESC, hex) for direct
                          reads, its cache map (MAP, hex msgpack of a
                          fabric.kv.direct.CacheMap) and block ids (comma
                          separated)
    direct N BATCH        read chunks 0 .. N-1 from the sender's cache into
                          this one, BATCH chunks per READ, and verify each
                          against the checksum the sender sends for it next,
                          one line ``sum I S`` per chunk as the sender hashed
                          it (read while the reads run; a chunk is verified
                          once both its read and its line are in)
    fabric-wait RID       wait until fabric verified every chunk of RID
    full RID N WHEN T     unpack RID's N chunks into the cache (T threads) as
                          each lands (WHEN=landed: verified meanwhile by the
                          server's verifier) or once verified (WHEN=verified)
    digest                checksum of the cache blocks the transfers target
    cpu                   this process's CPU seconds so far
    clear                 zero the cache (before a path whose bytes are checked)
    quit

A chunk covers ``chunk_tokens / block_size`` of the side's scattered
``block_ids``; chunk ``i`` of a transfer is blocks ``i * chunk_blocks ..``.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import numpy as np

from fabric.bench.geometry import paged_cache, preset
from fabric.bench.rawnixl import RawNixl, descs
from fabric.errors import ConfigError
from fabric.kv import KVLayout, pack, unpack
from fabric.kv.direct import (
    CacheMap,
    Spans,
    cache_regions,
    cache_spans,
    checksum_spans,
    direct_plan,
    map_spans,
)
from fabric.store import ChunkPool, ChunkStore, StoreConfig, checksum
from fabric.transfer import TransferConfig, TransferNode
from fabric.transfer.dataplane import XferState

MEMORY_KINDS = ("dram", "vram")
POLL_S = 2e-4
"""The receiver's steady polling rate (:meth:`RawNixl.wait_notifs`'s)."""
DIGEST_BLOCKS = 64


@dataclass(frozen=True)
class SideArgs:
    """What both sides agree on; ``chunk_tokens``/``transport`` are the first fabric setup."""

    geometry: str = "llama3-8b"
    kind: str = "flash"
    tokens: int = 2048
    chunk_tokens: int = 256
    block_size: int = 16
    progress_thread: bool = False
    transport: str = "nixl"
    memory: str = "dram"
    seed: int = 0
    tag: str = "p"

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_KINDS:
            raise ConfigError(f"memory: {self.memory!r} is not one of {MEMORY_KINDS}")
        if self.tokens % self.block_size or self.chunk_tokens % self.block_size:
            raise ConfigError("tokens and chunk_tokens must be multiples of block_size")


class FabricEnd:
    """fabric's chunk store and transfer node for one chunk size and transport."""

    def __init__(
        self, side: BenchSide, transport: str, chunk_tokens: int, name: str, *, serve: bool
    ) -> None:
        if chunk_tokens % side.args.block_size or chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens {chunk_tokens} is not a multiple of the block size")
        self.transport, self.chunk_tokens = transport, chunk_tokens
        self.chunk_blocks = chunk_tokens // side.args.block_size
        self.num_chunks = -(-side.used_blocks // self.chunk_blocks)
        self.slot_bytes = side.layout.chunk_nbytes(self.chunk_blocks)
        # NOTE: one slot per chunk and two spare; chunks of an earlier rep are
        # committed/filled and so evictable (LRU) when the next rep allocates.
        # NOTE: NIXL moves VRAM: a cache on the GPU gets its pool there (the
        # connector's pool_device auto), hashed with fold64 on the device
        pool_device = side.device if transport == "nixl" else "cpu"
        self.store = ChunkStore(
            StoreConfig(slot_bytes=self.slot_bytes, num_slots=self.num_chunks + 2),
            ChunkPool(self.num_chunks + 2, self.slot_bytes, device=pool_device),
        )
        config = TransferConfig(
            transport=transport,  # type: ignore[arg-type]
            nixl_progress_thread=side.args.progress_thread,
            ucx_net_devices="lo",
        )
        self.node = TransferNode(
            self.store, config, side.layout.fingerprint(), name=name, serve=serve
        )
        # NOTE: the direct path reads the peer's cache: NIXL, host memory only
        self.direct = transport == "nixl" and side.device == "cpu"
        if self.direct:
            try:
                for base, nbytes in cache_regions(side.views):
                    self.node.plane.register_region(base, nbytes, side.device)
            except BaseException:
                self.node.close()
                raise
        self.direct_peer: str | None = None

    def close(self) -> None:
        self.node.close()


def reader_used(before: dict[str, int], after: dict[str, int]) -> str:
    """How the plane read between two of its counter snapshots: "mapped"
    (most bytes out of the peer's shared memory), "in place"
    (``process_vm_readv``) or "ucx" (:mod:`fabric.transfer.local_read`)."""
    local = after.get("local_bytes", 0) - before.get("local_bytes", 0)
    mapped = after.get("mapped_bytes", 0) - before.get("mapped_bytes", 0)
    if local and mapped >= 0.9 * local:
        return "mapped"
    return "in place" if local else "ucx"


class Lines:
    """Lines of a pipe, read without blocking when asked (``poll``): the
    direct path takes the sender's checksums while its reads run."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self.buf = b""

    def _take(self) -> str | None:
        head, sep, tail = self.buf.partition(b"\n")
        if not sep:
            return None
        self.buf = tail
        return head.decode()

    def _read(self) -> bool:
        data = os.read(self.fd, 1 << 16)
        self.buf += data
        return bool(data)

    def poll(self) -> str | None:
        """The next line if one is there, else None at once (EOFError at the end)."""
        line = self._take()
        if line is None and select.select([self.fd], [], [], 0)[0]:
            if not self._read():
                raise EOFError("the sender closed the pipe")
            line = self._take()
        return line

    def wait(self, timeout: float) -> None:
        """Return once a line may be there or ``timeout`` passed."""
        if b"\n" not in self.buf:
            select.select([self.fd], [], [], timeout)

    def get(self) -> str | None:
        """The next line (None at the end of the pipe)."""
        while (line := self._take()) is None:
            if not self._read():
                return None
        return line


class BenchSide:
    """Everything one process needs for every path of the benchmark."""

    def __init__(self, args: SideArgs, *, serve: bool = True) -> None:
        self.args = args
        self.serving = serve
        self.geometry = preset(args.geometry)
        self.device = "cuda" if args.memory == "vram" else "cpu"
        self.used_blocks = args.tokens // args.block_size
        self.num_blocks = 2 * self.used_blocks
        kind = self.geometry.layout_kind(args.kind)
        self.storage, self.views = paged_cache(
            self.geometry,
            kind,
            self.num_blocks,
            args.block_size,
            seed=args.seed,
            device=self.device,
        )
        rng = np.random.default_rng(args.seed + 100)
        self.block_ids = rng.permutation(self.num_blocks)[: self.used_blocks].astype(np.int64)
        self.layout = KVLayout.from_tensors(self.views, model=args.geometry)
        mem_type = "VRAM" if self.device == "cuda" else "DRAM"
        self.raw = RawNixl(
            f"bench-raw-{args.tag}", progress_thread=args.progress_thread, mem_type=mem_type
        )
        self.raw.register(self.storage)
        self.fabric: FabricEnd | None = None
        self.lines = Lines()
        self.peer_map: CacheMap | None = None
        self.peer_ids = np.zeros(0, dtype=np.int64)
        self._setups = 0
        self.use_fabric(args.transport, args.chunk_tokens)

    def use_fabric(self, transport: str, chunk_tokens: int) -> FabricEnd:
        """The fabric end for ``transport`` and ``chunk_tokens``, rebuilt if it differs."""
        end = self.fabric
        if end is not None and (end.transport, end.chunk_tokens) == (transport, chunk_tokens):
            return end
        if end is not None:
            end.close()
            self.fabric = None  # NOTE: drop the old pool before allocating the next
        self._setups += 1
        name = f"bench-fabric-{self.args.tag}-{self._setups}"
        self.fabric = FabricEnd(self, transport, chunk_tokens, name, serve=self.serving)
        return self.fabric

    @property
    def end(self) -> FabricEnd:
        assert self.fabric is not None
        return self.fabric

    @property
    def kv_base(self) -> int:
        return int(self.storage.data_ptr())

    @property
    def device_id(self) -> int:
        return int(self.storage.device.index or 0)

    @property
    def total_bytes(self) -> int:
        return self.used_blocks * self.layout.block_bytes

    def chunk_block_ids(self, chunk_blocks: int, index: int) -> np.ndarray:
        start = index * chunk_blocks
        return self.block_ids[start : start + chunk_blocks]

    def page_descs(self, kv_base: int) -> np.ndarray:
        """One descriptor per (layer, K/V, block) of a cache at ``kv_base``."""
        rows = self.layout.num_layers * self.layout.segments * self.num_blocks
        return descs(
            kv_base + np.arange(rows, dtype=np.uint64) * self.layout.segment_bytes,
            self.layout.segment_bytes,
            self.device_id,
        )

    def page_indices(self, block_ids: np.ndarray) -> np.ndarray:
        """Indices into ``page_descs`` of ``block_ids`` in every row, layer-major."""
        rows = np.arange(self.layout.num_layers * self.layout.segments, dtype=np.int64)
        return (rows[:, None] * self.num_blocks + block_ids[None, :]).reshape(-1)

    def chunk_spans(self, index: int) -> Spans:
        """Where chunk ``index`` lies in this cache."""
        return cache_spans(
            self.views, self.layout, self.chunk_block_ids(self.end.chunk_blocks, index)
        )

    def peer_spans(self, index: int) -> Spans:
        """Where chunk ``index`` lies in the sender's cache (its map and block ids)."""
        assert self.peer_map is not None
        blocks = self.end.chunk_blocks
        ids = self.peer_ids[index * blocks : (index + 1) * blocks]
        return map_spans(self.peer_map, self.layout, ids)

    def chunk_checksum(self, index: int) -> int:
        """The checksum of chunk ``index`` packed, hashed in place (the direct path)."""
        spans = self.chunk_spans(index)
        return checksum_spans(spans.addrs, spans.lengths)

    def digest(self) -> int:
        """Checksum of the used blocks, packed in order into a host buffer."""
        import torch

        buf = torch.empty(self.layout.chunk_nbytes(DIGEST_BLOCKS), dtype=torch.uint8)
        total = 0
        for start in range(0, self.used_blocks, DIGEST_BLOCKS):
            n = pack(self.views, self.layout, self.block_ids[start : start + DIGEST_BLOCKS], buf)
            total = (total * 1_000_003 + checksum(buf[:n])) % (1 << 64)
        return total

    def hello(self) -> dict[str, Any]:
        return {
            "endpoint": self.end.node.endpoint,
            "raw_metadata": self.raw.metadata().hex(),
            "kv_base": self.kv_base,
            "block_ids": self.block_ids.tolist(),
        }

    # ---------------------------------------------------------- receiver
    def wait_fabric(self, rid: str) -> dict[str, Any]:
        """Times (monotonic, shared by both processes) when every chunk of
        ``rid`` had landed (notified) and when every chunk was verified."""
        server = self.end.node.server
        assert server is not None
        landed = server.wait_until(rid, lambda p: p.expected <= p.landed, 120)
        landed_at = time.monotonic()
        prog = server.wait(rid, 120)
        verified_at = time.monotonic()
        server.release(rid)
        return {
            "complete": bool(landed and prog and prog.complete),
            "landed_at": landed_at,
            "verified_at": verified_at,
        }

    def unpack_as_landed(self, rid: str, count: int, when: str, threads: int) -> dict[str, Any]:
        """Unpack chunks ``0 .. count - 1`` of ``rid`` into the paged cache.

        ``when="landed"``: unpack a chunk as soon as its notification arrived,
        while the server's verifier hashes it (both read the slot at about the
        same time); the request is complete once every chunk is unpacked *and*
        verified, so nothing unverified is ever reported usable.
        ``when="verified"``: unpack only verified chunks.
        """
        end = self.end
        server = end.node.server
        assert server is not None

        def ready(p: Any) -> set[int]:
            return set(p.landed if when == "landed" else p.filled)

        done: set[int] = set()
        deadline = time.monotonic() + 120
        while len(done) < count and time.monotonic() < deadline:
            prog = server.wait_until(rid, lambda p: bool(ready(p) - done), 1.0)
            res = end.store.reservation(rid)
            if prog is None or res is None:
                time.sleep(1e-3)  # the Reserve has not reached the server yet
                continue
            if prog.failed:
                break
            for i in sorted(ready(prog) - done):
                ids = self.chunk_block_ids(end.chunk_blocks, i)
                src = end.store.pool.slot_view(res.slots[i])
                unpack(src, self.views, self.layout, ids, num_threads=threads)
                done.add(i)
        final = server.wait(rid, max(0.0, deadline - time.monotonic()))
        server.release(rid)
        return {"complete": len(done) == count and bool(final and final.complete)}

    def load_direct_peer(
        self, descriptor: str, cmap: str, ids: str, regions: str
    ) -> dict[str, Any]:
        end = self.end
        if not end.direct:
            return {"error": f"no direct reads over {end.transport} from {self.device} memory"}
        if end.direct_peer is not None:
            end.node.plane.remove_peer(end.direct_peer)
        end.direct_peer = end.node.plane.add_peer(bytes.fromhex(descriptor))
        end.node.plane.add_regions(end.direct_peer, bytes.fromhex(regions))
        self.peer_map = msgspec.msgpack.decode(bytes.fromhex(cmap), type=CacheMap)
        self.peer_ids = np.asarray([int(i) for i in ids.split(",")], dtype=np.int64)
        return {"ok": True}

    def read_direct(self, count: int, batch: int, lines: Lines) -> dict[str, Any]:
        """Read chunks ``0 .. count - 1`` of the sender's cache into this one and
        verify each against the sender's checksum (see the module docstring).

        The reads are posted first; the sender's checksum lines are taken
        while they run, and a chunk is hashed once its read is done and its
        checksum known. Complete only when every chunk matched.
        """
        end = self.end
        assert end.direct_peer is not None, "direct-peer first"
        before = end.node.plane.counters()
        plans = [direct_plan(self.peer_spans(i), self.chunk_spans(i)) for i in range(count)]
        pending = []
        for start in range(0, count, batch):
            group = range(start, min(start + batch, count))
            rows = np.concatenate([plans[i].read_rows() for i in group])
            # NOTE: the sender learns its blocks were read from the READ's notification
            handle = end.node.plane.post_read(end.direct_peer, rows, b"direct-read")
            pending.append((handle, group))
        sums: dict[int, int] = {}
        landed: list[int] = []
        bad: list[int] = []
        verified, failed = 0, False
        deadline = time.monotonic() + 120
        while (verified + len(bad) < count) and not failed and time.monotonic() < deadline:
            while len(sums) < count and (line := lines.poll()) is not None:
                _, index, value = line.split()
                sums[int(index)] = int(value)
            for entry in list(pending):
                state = entry[0].poll()
                if state is XferState.PROC:
                    continue
                entry[0].release()
                pending.remove(entry)
                if state is XferState.ERR:
                    failed = True
                else:
                    landed.extend(entry[1])
            ready = [i for i in landed if i in sums]
            landed = [i for i in landed if i not in sums]
            for i in ready:
                if checksum_spans(plans[i].dst, plans[i].lengths) == sums[i]:
                    verified += 1
                else:
                    bad.append(i)
            if not ready:
                # NOTE: the steady rate the page path's receiver polls at (a
                # copy in place runs on a thread of this process: no spinning)
                lines.wait(POLL_S)
        for handle, _ in pending:  # NOTE: nothing may land after the answer
            handle.abort()
        for _ in range(count - len(sums)):  # NOTE: keep the pipe in step
            if lines.get() is None:
                break
        return {
            "complete": verified == count,
            "bad": bad,
            "failed": failed,
            "reader": reader_used(before, end.node.plane.counters()),
        }

    def handle(self, cmd: str, rest: list[str]) -> dict[str, Any]:
        """Answer one receiver command (see the module docstring)."""
        if cmd == "fabric":
            self.use_fabric(rest[0], int(rest[1]))
            return {"endpoint": self.end.node.endpoint}
        if cmd == "raw":
            return {"got": self.raw.wait_notifs(int(rest[0]), 120)}
        if cmd == "direct-peer":
            return self.load_direct_peer(*rest)
        if cmd == "direct":
            return self.read_direct(int(rest[0]), int(rest[1]), self.lines)
        if cmd == "fabric-wait":
            return self.wait_fabric(rest[0])
        if cmd == "full":
            return self.unpack_as_landed(rest[0], int(rest[1]), rest[2], int(rest[3]))
        if cmd == "digest":
            return {"digest": self.digest()}
        if cmd == "cpu":
            return {"cpu": time.process_time()}
        if cmd == "clear":
            self.storage.zero_()
            return {"ok": True}
        return {"error": f"unknown command {cmd!r}"}

    def serve(self) -> None:
        print(json.dumps(self.hello()), flush=True)
        while (line := self.lines.get()) is not None:
            cmd, *rest = line.split()
            if cmd == "quit":
                break
            print(json.dumps(self.handle(cmd, rest)), flush=True)

    def close(self) -> None:
        if self.fabric is not None:
            self.fabric.close()
        self.raw.close()


def side_args_json(args: SideArgs) -> str:
    return json.dumps(asdict(args))


if __name__ == "__main__":
    side = BenchSide(SideArgs(**json.loads(sys.argv[1])))
    try:
        side.serve()
    finally:
        side.close()
