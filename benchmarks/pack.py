"""Benchmark fabric.kv pack/unpack against a plain memcpy of the same bytes.

Llama-3-8B KV geometry (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB per
token) in the vLLM CPU layout (block_size 128) and the flash layout (block_size
16). A 4096-token prompt's blocks are scattered over a pool 1.5x that size;
each rep packs the prompt as 256-token chunks into a contiguous store buffer
(512 MiB, far larger than the last-level cache) and unpacks it back. The
baseline is ``dst.copy_(src)`` of two contiguous uint8 tensors of the same
size, at torch's default thread count.

A prefiller packs each chunk and checksums it for the store: ``pack`` then
an xxh3-64 pass over the slot ("separate", what fabric did before), or
``pack_checksummed`` (each piece's source hashed as the copy reads it, one
thread; copies under ``FUSED_MIN_COPY_BYTES`` on average are packed, then
hashed). Both are timed alternately per rep; each row gives the median of
the per-rep time ratios with a bootstrap 90% interval, the path taken, and
the same with the fused path forced (how the threshold was chosen); the
summary covers the shipped rows.

Run: ``python benchmarks/pack.py`` (``--checksum`` for the fused-checksum
comparison alone). Prints a table, writes
``benchmarks/results/pack-<date>.json``, and ends with one JSON line holding
the worst layout's pack/unpack to memcpy ratios (default backend and
threads) and the fused checksum's time ratio.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from fabric.kv import KVLayout, LayoutKind, backend, pack, pack_checksummed, unpack
from fabric.kv.pack import DEFAULT_NUM_THREADS, FUSED_MIN_COPY_BYTES, Backend, copy_plan

pack_module = importlib.import_module("fabric.kv.pack")  # NOTE: fabric.kv.pack is the function

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
PROMPT_TOKENS, CHUNK_TOKENS, POOL_FACTOR = 4096, 256, 1.5
REPS = 11
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Setup:
    """One layout's cache, the prompt's scattered blocks, and a store buffer."""

    name: str
    layout: KVLayout
    caches: list[torch.Tensor]
    chunks: list[np.ndarray]  # block ids of each chunk
    store: torch.Tensor  # uint8, one chunk after another

    @property
    def nbytes(self) -> int:
        return self.layout.chunk_nbytes(sum(len(c) for c in self.chunks))

    def slot(self, i: int) -> torch.Tensor:
        size = self.layout.chunk_nbytes(CHUNK_TOKENS // self.layout.block_size)
        return self.store[i * size : (i + 1) * size]


def build(name: str, kind: LayoutKind, block_size: int, seed: int = 0) -> Setup:
    """Allocate (and touch) a pool, shuffle block ids, cut them into chunks."""
    num_blocks = int(PROMPT_TOKENS * POOL_FACTOR) // block_size
    if kind is LayoutKind.FLASH:
        shape: tuple[int, ...] = (2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    else:
        shape = (num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_DIM)
    caches = [torch.full(shape, float(i), dtype=torch.bfloat16) for i in range(NUM_LAYERS)]
    layout = KVLayout.from_tensors(caches, model="meta-llama/Meta-Llama-3-8B")
    ids = np.random.default_rng(seed).permutation(num_blocks)[: PROMPT_TOKENS // block_size]
    chunks = np.split(ids, PROMPT_TOKENS // CHUNK_TOKENS)
    store = torch.ones(layout.chunk_nbytes(len(ids)), dtype=torch.uint8)
    return Setup(name, layout, caches, chunks, store)


def pack_all(setup: Setup, use: Backend, threads: int) -> None:
    for i, ids in enumerate(setup.chunks):
        pack(setup.caches, setup.layout, ids, setup.slot(i), backend=use, num_threads=threads)


def unpack_all(setup: Setup, use: Backend, threads: int) -> None:
    for i, ids in enumerate(setup.chunks):
        unpack(setup.slot(i), setup.caches, setup.layout, ids, backend=use, num_threads=threads)


def pack_hashed_all(setup: Setup, fused: bool) -> None:
    """Pack every chunk and checksum it, as the worker does for its store."""
    for i, ids in enumerate(setup.chunks):
        slot = setup.slot(i)
        if fused:
            pack_checksummed(setup.caches, setup.layout, ids, slot)
        else:
            nbytes = pack(setup.caches, setup.layout, ids, slot, backend="c", num_threads=1)
            xxhash.xxh3_64_intdigest(slot[:nbytes].numpy())


def measure_checksum(setup: Setup, reps: int = 3 * REPS, *, forced: bool = False) -> dict[str, Any]:
    """``pack_checksummed`` against separate pack+checksum, alternately;
    per-rep time ratios. ``forced``: its fused path even where the mean copy
    is under ``FUSED_MIN_COPY_BYTES`` (how that threshold was chosen)."""
    if forced:
        pack_module.FUSED_MIN_COPY_BYTES = 0
    try:
        return _measure_checksum(setup, reps, forced)
    finally:
        pack_module.FUSED_MIN_COPY_BYTES = FUSED_MIN_COPY_BYTES


def _measure_checksum(setup: Setup, reps: int, forced: bool) -> dict[str, Any]:
    _, _, lengths = copy_plan(setup.caches, setup.layout, setup.chunks[0], 0)
    fused_path = forced or lengths.mean() >= FUSED_MIN_COPY_BYTES
    fused, separate = (functools.partial(pack_hashed_all, setup, f) for f in (True, False))
    fused()
    separate()
    ratios, times = [], {"fused": [], "separate": []}  # type: ignore[var-annotated]
    for rep in range(reps):
        order = [("fused", fused), ("separate", separate)][:: 1 if rep % 2 else -1]
        took = {}
        for name, fn in order:
            start = time.perf_counter()
            fn()
            took[name] = time.perf_counter() - start
            times[name].append(took[name])
        ratios.append(took["fused"] / took["separate"])
    rng = np.random.default_rng(0)
    boot = np.median(rng.choice(ratios, (2000, len(ratios))), axis=1)
    return {
        "layout": setup.name,
        "op": "pack+checksum",
        "path": "fused" if fused_path else "pack-then-hash",
        "forced": forced,
        "mean_copy_bytes": int(lengths.mean()),
        "reps": reps,
        "fused_gbps": round(setup.nbytes / statistics.median(times["fused"]) / 1e9, 2),
        "separate_gbps": round(setup.nbytes / statistics.median(times["separate"]) / 1e9, 2),
        "time_ratio_fused_over_separate": round(statistics.median(ratios), 3),
        "ratio_interval_90": [round(float(q), 3) for q in np.quantile(boot, [0.05, 0.95])],
    }


def paired_gbps(
    fn: Callable[[], None], baseline: Callable[[], None], nbytes: int, reps: int = REPS
) -> tuple[float, float]:
    """Median GB/s of ``fn`` and ``baseline``, warm, timed alternately.

    NOTE: alternating keeps both under the same load; the dev VM is shared
    with other jobs and a separate memcpy run can land in a quieter moment.
    """
    fn()
    baseline()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for f, out in ((fn, times[0]), (baseline, times[1])):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[0]) / 1e9, nbytes / statistics.median(times[1]) / 1e9


def variants() -> list[tuple[Backend, int]]:
    """(backend, threads) to measure; the default one first."""
    if backend() != "c":
        return [("torch", 1)]
    others: list[tuple[Backend, int]] = [("c", t) for t in (1, 2) if t != DEFAULT_NUM_THREADS]
    return [("c", DEFAULT_NUM_THREADS), *others, ("torch", 1)]


def measure(setup: Setup) -> list[dict[str, Any]]:
    """Rows of (layout, op, backend, threads, GB/s, memcpy GB/s, ratio)."""
    src = torch.ones(setup.nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    rows = []
    default = variants()[0]

    def copy() -> None:
        dst.copy_(src)

    for use, threads in variants():
        for op, fn in (("pack", pack_all), ("unpack", unpack_all)):
            run = functools.partial(fn, setup, use, threads)
            gbps, memcpy = paired_gbps(run, copy, setup.nbytes)
            rows.append(
                {
                    "layout": setup.name,
                    "op": op,
                    "backend": use,
                    "threads": threads,
                    "gbps": round(gbps, 2),
                    "memcpy_gbps": round(memcpy, 2),
                    "ratio": round(gbps / memcpy, 3),
                    "default": (use, threads) == default,
                }
            )
    return rows


def machine() -> dict[str, object]:
    return {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "backend": backend(),
        "default_num_threads": DEFAULT_NUM_THREADS,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'layout':<7} {'op':<7} {'backend':<8} {'GB/s':>7} {'memcpy GB/s':>12} {'ratio':>6}")
    for r in rows:
        mark = " *" if r["default"] else ""
        name = f"{r['backend']}x{r['threads']}"
        print(
            f"{r['layout']:<7} {r['op']:<7} {name:<8} {r['gbps']:>7.2f} "
            f"{r['memcpy_gbps']:>12.2f} {r['ratio']:>6.3f}{mark}"
        )
    print("(* default backend/threads; memcpy = torch dst.copy_(src) of the same bytes)")


def worst_ratio(rows: list[dict[str, Any]], op: str) -> float:
    return min(float(r["ratio"]) for r in rows if r["default"] and r["op"] == op)


def main() -> None:
    checksum_only = "--checksum" in sys.argv[1:]
    info = machine()
    print(f"machine: {json.dumps(info)}")
    rows: list[dict[str, Any]] = []
    fused: list[dict[str, Any]] = []
    for name, kind, block_size in (("cpu", LayoutKind.CPU, 128), ("flash", LayoutKind.FLASH, 16)):
        setup = build(name, kind, block_size)  # one pool alive at a time
        if not checksum_only:
            rows += measure(setup)
        if backend() == "c":
            for forced in (False, True):
                fused.append(measure_checksum(setup, forced=forced))
                print(json.dumps(fused[-1]))
    summary: dict[str, Any] = {}
    if rows:
        print_table(rows)
        summary["pack_vs_memcpy"] = worst_ratio(rows, "pack")
        summary["unpack_vs_memcpy"] = worst_ratio(rows, "unpack")
    if fused:
        shipped = [r for r in fused if not r["forced"]]  # NOTE: as fabric packs
        worst = max(shipped, key=lambda r: r["time_ratio_fused_over_separate"])
        summary["pack_checksum_fused_over_separate_max"] = worst["time_ratio_fused_over_separate"]
        summary["pack_checksum_fused_over_separate_hi"] = max(
            r["ratio_interval_90"][1] for r in shipped
        )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = "pack-checksum" if checksum_only else "pack"
    out = RESULTS_DIR / f"{stem}-{datetime.date.today().isoformat()}.json"
    record = {"machine": info, "rows": rows, "checksum": fused, "summary": summary}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
