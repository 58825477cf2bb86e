"""One side of the transfer benchmark: a paged KV cache, a store, fabric, raw NIXL.

Both processes of ``fabric.bench.transfer`` build the same objects; the
receiver (``python -m fabric.bench.transfer_side ARGS_JSON``) then answers
one JSON line per command on stdin:

    raw N          wait for N raw-NIXL notifications
    fabric RID     wait until fabric verified every chunk of RID, release it
    full RID N     unpack RID's chunks into the paged cache as each lands
    digest         checksum of the cache blocks the transfer targets
    quit
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fabric.bench.geometry import paged_cache, preset
from fabric.bench.rawnixl import RawNixl, descs
from fabric.kv import KVLayout, pack, unpack
from fabric.store import ChunkStore, StoreConfig, checksum
from fabric.transfer import TransferConfig, TransferNode


@dataclass(frozen=True)
class SideArgs:
    geometry: str = "llama3-8b"
    kind: str = "flash"
    tokens: int = 2048
    chunk_tokens: int = 256
    block_size: int = 16
    progress_thread: bool = False
    transport: str = "nixl"
    seed: int = 0
    tag: str = "p"


class BenchSide:
    """Everything one process needs for every path of the benchmark."""

    def __init__(self, args: SideArgs) -> None:
        self.args = args
        geom = preset(args.geometry)
        self.used_blocks = args.tokens // args.block_size
        self.num_blocks = 2 * self.used_blocks
        self.storage, self.views = paged_cache(
            geom, args.kind, self.num_blocks, args.block_size, seed=args.seed
        )
        rng = np.random.default_rng(args.seed + 100)
        self.block_ids = rng.permutation(self.num_blocks)[: self.used_blocks].astype(np.int64)
        self.layout = KVLayout.from_tensors(self.views, model=args.geometry)
        self.chunk_blocks = args.chunk_tokens // args.block_size
        self.num_chunks = -(-self.used_blocks // self.chunk_blocks)
        self.slot_bytes = self.layout.chunk_nbytes(self.chunk_blocks)
        self.store = ChunkStore(
            StoreConfig(slot_bytes=self.slot_bytes, num_slots=2 * self.num_chunks + 2)
        )
        config = TransferConfig(
            transport=args.transport,  # type: ignore[arg-type]
            nixl_progress_thread=args.progress_thread,
            ucx_net_devices="lo",
        )
        self.node = TransferNode(
            self.store, config, self.layout.fingerprint(), name=f"bench-fabric-{args.tag}"
        )
        self.raw = RawNixl(f"bench-raw-{args.tag}", progress_thread=args.progress_thread)
        self.raw.register(self.store.pool.buffer)
        self.raw.register(self.storage)

    @property
    def kv_base(self) -> int:
        return int(self.storage.data_ptr())

    @property
    def total_bytes(self) -> int:
        return self.used_blocks * self.layout.block_bytes

    def chunk_block_ids(self, index: int) -> np.ndarray:
        start = index * self.chunk_blocks
        return self.block_ids[start : start + self.chunk_blocks]

    def page_descs(self, kv_base: int) -> np.ndarray:
        """One descriptor per (layer, K/V, block) of a cache at ``kv_base``."""
        rows = self.layout.num_layers * self.layout.segments * self.num_blocks
        return descs(
            kv_base + np.arange(rows, dtype=np.uint64) * self.layout.segment_bytes,
            self.layout.segment_bytes,
        )

    def page_indices(self) -> np.ndarray:
        """Indices into ``page_descs`` of this side's used blocks, layer-major."""
        rows = np.arange(self.layout.num_layers * self.layout.segments, dtype=np.int64)
        return (rows[:, None] * self.num_blocks + self.block_ids[None, :]).reshape(-1)

    def digest(self) -> int:
        """Checksum of the used blocks, packed in chunk order."""
        buf = self.store.pool.slot_view(self.store.pool.num_slots - 1)
        total = 0
        for i in range(self.num_chunks):
            n = pack(self.views, self.layout, self.chunk_block_ids(i), buf)
            total = (total * 1_000_003 + checksum(buf[:n])) % (1 << 64)
        return total

    def hello(self) -> dict[str, Any]:
        return {
            "endpoint": self.node.endpoint,
            "raw_metadata": self.raw.metadata().hex(),
            "pool_base": self.store.pool.base_address,
            "kv_base": self.kv_base,
            "block_ids": self.block_ids.tolist(),
        }

    # ---------------------------------------------------------- receiver
    def wait_fabric(self, rid: str) -> dict[str, Any]:
        """Times (monotonic, shared by both processes) when every chunk of
        ``rid`` had landed (notified) and when every chunk was verified."""
        server = self.node.server
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

    def unpack_as_landed(self, rid: str, count: int) -> dict[str, Any]:
        """Unpack each chunk of ``rid`` into the paged cache once verified."""
        server = self.node.server
        assert server is not None
        done: set[int] = set()
        deadline = time.monotonic() + 120
        while len(done) < count and time.monotonic() < deadline:
            prog = server.wait_until(rid, lambda p: bool(p.filled - done), 1.0)
            res = self.store.reservation(rid)
            if prog is None or res is None:
                time.sleep(1e-3)  # the Reserve has not reached the server yet
                continue
            if prog.failed:
                break
            for i in sorted(prog.filled - done):
                unpack(
                    self.store.pool.slot_view(res.slots[i]),
                    self.views,
                    self.layout,
                    self.chunk_block_ids(i),
                )
                done.add(i)
        server.release(rid)
        return {"complete": len(done) == count}

    def serve(self) -> None:
        print(json.dumps(self.hello()), flush=True)
        for line in sys.stdin:
            cmd, *rest = line.split()
            if cmd == "quit":
                break
            if cmd == "raw":
                out: dict[str, Any] = {"got": self.raw.wait_notifs(int(rest[0]), 120)}
            elif cmd == "fabric":
                out = self.wait_fabric(rest[0])
            elif cmd == "full":
                out = self.unpack_as_landed(rest[0], int(rest[1]))
            elif cmd == "digest":
                out = {"digest": self.digest()}
            else:
                out = {"error": cmd}
            print(json.dumps(out), flush=True)

    def close(self) -> None:
        self.node.close()


def side_args_json(args: SideArgs) -> str:
    return json.dumps(asdict(args))


if __name__ == "__main__":
    side = BenchSide(SideArgs(**json.loads(sys.argv[1])))
    try:
        side.serve()
    finally:
        side.close()
