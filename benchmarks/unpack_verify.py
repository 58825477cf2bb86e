"""What verifying a chunk at use costs: ``unpack(..., checksum=)`` vs plain ``unpack``.

Llama-3-8B KV geometry (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB per
token) in the flash layout (block_size 16): a 2048-token prompt (256 MiB) as
eight 256-token chunks in store slots, unpacked into blocks scattered over a
pool 1.5x that size. Variants, alternated rep by rep (medians of ``REPS``):

- ``plain``: unpack, default threads (what the loader does today);
- ``plain-1t``: unpack on one thread;
- ``verified``: unpack with checksum= (hash fused with the copy, one pass);
- ``plain+hash``: plain unpack then a one-shot xxh3-64 of each slot (two passes);
- ``hash``: the one-shot xxh3-64 alone.

Each variant reports wall time and CPU time (all threads of the process):
on a machine other work is loading, CPU time is the steadier measure of
what a variant costs. Run: ``python benchmarks/unpack_verify.py [--torch]``
(``--torch``: the fallback backend too). Prints one line per variant and a
JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from fabric.kv import KVLayout, pack, unpack
from fabric.kv.pack import Backend

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
PROMPT_TOKENS, CHUNK_TOKENS, POOL_FACTOR = 2048, 256, 1.5
REPS = 15


def setup() -> tuple[list[torch.Tensor], KVLayout, list[np.ndarray], list[torch.Tensor]]:
    blocks = PROMPT_TOKENS // BLOCK_SIZE
    pool = int(blocks * POOL_FACTOR)
    shape = (2, pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    layout = KVLayout.from_tensors(caches)
    ids = np.random.default_rng(0).permutation(pool)[:blocks]
    per_chunk = CHUNK_TOKENS // BLOCK_SIZE
    chunk_ids = [ids[i : i + per_chunk] for i in range(0, blocks, per_chunk)]
    slots = [torch.empty(layout.chunk_nbytes(per_chunk), dtype=torch.uint8) for _ in chunk_ids]
    for slot, part in zip(slots, chunk_ids, strict=True):
        pack(caches, layout, part, slot)
    return caches, layout, chunk_ids, slots


def main() -> None:
    caches, layout, chunk_ids, slots = setup()
    sums = [xxhash.xxh3_64_intdigest(s.numpy()) for s in slots]
    total = sum(s.numel() for s in slots)
    work = list(zip(slots, chunk_ids, sums, strict=True))

    def run(use: Backend, threads: int | None, verify: bool, hash_after: bool) -> None:
        for slot, part, value in work:
            kw = {"checksum": value, "nbytes": slot.numel()} if verify else {}
            unpack(slot, caches, layout, part, backend=use, num_threads=threads, **kw)
            if hash_after:
                assert xxhash.xxh3_64_intdigest(slot.numpy()) == value

    variants: dict[str, Callable[[], None]] = {
        "plain": lambda: run("c", None, False, False),
        "plain-1t": lambda: run("c", 1, False, False),
        "verified": lambda: run("c", None, True, False),
        "plain+hash": lambda: run("c", None, False, True),
        "hash": lambda: [xxhash.xxh3_64_intdigest(s.numpy()) for s in slots] and None,
    }
    if "--torch" in sys.argv:
        variants |= {
            "torch-plain": lambda: run("torch", None, False, False),
            "torch-verified": lambda: run("torch", None, True, False),
        }
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(REPS):
        for name, fn in variants.items():
            cpu_start, start = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
    out = {}
    for name in variants:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        out[name] = {"wall_ms": round(w * 1e3, 1), "cpu_ms": round(c * 1e3, 1)}
        rate = total / w / 1e9
        print(f"{name:15s} wall {w * 1e3:7.1f} ms ({rate:5.2f} GB/s)  cpu {c * 1e3:7.1f} ms")
    for base in ("plain", "plain-1t"):
        ratio = out["verified"]["cpu_ms"] / out[base]["cpu_ms"]
        print(f"verified / {base}: {ratio:.2f}x cpu")
    print(json.dumps({"bytes": total, "reps": REPS} | out))


if __name__ == "__main__":
    main()
