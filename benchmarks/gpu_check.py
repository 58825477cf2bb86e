"""GPU check of the fused pack/unpack kernels (fabric/kv/csrc/): bit-exactness and GB/s.

Run on a machine with a CUDA device (``benchmarks/gpu_check.sh`` sets up the
environment and calls this). Steps:

1. build (JIT) or import the extension, fail loudly if it does not load;
2. bit-exact round trips of the fused kernels against the torch indexing
   path for every layout (FLASH, HND, CPU-style, MLA) and dtype (bf16, fp16,
   fp8 bytes), full and partial chunks, unaligned chunk buffers; the fold64
   checksum kernel against torch ops (and the plain definition) for odd
   lengths and unaligned starts, and a VRAM ChunkPool's slot checksum;
3. Llama-3-8B KV geometry (32 layers, 8 KV heads, head_dim 128, bf16,
   16-token blocks, flash layout), a prompt's shuffled blocks cut into
   256-token chunks: pack/unpack GB/s of the fused kernel (launched directly,
   and through ``fabric.kv.pack`` with its side stream), of torch indexing,
   of the fold64 kernel over each chunk, and of a device-to-device ``copy_``
   of each chunk's bytes;
4. two processes on this GPU push the same prompt's cache through fabric's
   store with its pool in VRAM (``fabric bench transfer --memory vram``:
   fused pack, fold64, NIXL WRITE, fold64 verify, fused unpack) next to a
   raw NIXL VRAM WRITE of the same bytes (needs nixl; skipped, and said so,
   without it).

Writes ``benchmarks/results/gpu-check-<date>.json`` and ends with one JSON
line ``{"bit_exact": .., "pack_vs_d2d": .., "unpack_vs_d2d": ..,
"push_vs_raw_vram": .., "fold64_vs_d2d": ..}`` (fused kernel launched
directly vs ``copy_``, same bytes, same number of launches; the push is
fabric's full path over raw NIXL, GB/s).
"""

from __future__ import annotations

import argparse
import datetime
import json
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

from fabric.kv import KVLayout, LayoutKind, pack, unpack
from fabric.kv import cuda as kv_cuda
from fabric.kv.fold64 import fold64, fold64_reference, fold64_tensor
from fabric.kv.kernels import TorchIndexKernels
from fabric.kv.pack import segment_views

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CHUNK_TOKENS = 32, 8, 128, 16, 256
LAYOUTS = ("flash", "hnd", "cpu", "mla")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=16384, help="tokens packed per rep")
    parser.add_argument("--pool-factor", type=float, default=1.5, help="cache pool / prompt size")
    parser.add_argument("--reps", type=int, default=10, help="timed reps per variant")
    parser.add_argument("--skip-bench", action="store_true", help="correctness checks only")
    parser.add_argument("--push-reps", type=int, default=5, help="timed reps of the VRAM push")
    parser.add_argument("--skip-push", action="store_true", help="no two-process NIXL push")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON file")
    return parser.parse_args(argv)


# --- correctness ------------------------------------------------------------------


def fp8_dtype() -> torch.dtype:
    return getattr(torch, "float8_e4m3fn", torch.uint8)


def random_caches(
    name: str, dtype: torch.dtype, num_blocks: int, head_dim: int, block_size: int, seed: int
) -> tuple[list[torch.Tensor], KVLayout]:
    """Random bytes (NaN patterns included) in one layout; HND is a contiguous
    ``[2, blocks, heads, bs, hd]`` tensor, which whole-block copies treat as FLASH."""
    layers, heads = 4, 4
    shape = {
        "flash": (2, num_blocks, block_size, heads, head_dim),
        "hnd": (2, num_blocks, heads, block_size, head_dim),
        "cpu": (num_blocks, heads, block_size, 2 * head_dim),
        "mla": (num_blocks, block_size, head_dim),
    }[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    caches = [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
        .view(dtype)
        .view(shape)
        for _ in range(layers)
    ]
    kind = LayoutKind.FLASH if name in ("flash", "hnd") else None
    return caches, KVLayout.from_tensors(caches, kind=kind)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def check_case(
    kernels: kv_cuda.CudaKernels,
    name: str,
    dtype: torch.dtype,
    num_ids: int,
    head_dim: int,
    block_size: int,
    offset: int,
) -> dict[str, Any]:
    """Pack and unpack one case with the fused kernels and torch; compare bytes."""
    caches, layout = random_caches(name, dtype, 64, head_dim, block_size, num_ids + offset)
    ids = np.random.default_rng(num_ids).permutation(64)[:num_ids].astype(np.int64)
    nbytes = layout.chunk_nbytes(num_ids)
    buffer = torch.full((nbytes + offset + 64,), 0xA5, dtype=torch.uint8, device="cuda")
    got = buffer[offset : offset + nbytes]
    kernels.pack(segment_views(caches, layout), ids, got)
    want = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    TorchIndexKernels().pack(segment_views(caches, layout), ids, want)
    fresh = [torch.zeros_like(t) for t in caches]
    kernels.unpack(got, segment_views(fresh, layout), ids)
    expect = [torch.zeros_like(t) for t in caches]
    TorchIndexKernels().unpack(want, segment_views(expect, layout), ids)
    torch.cuda.synchronize()
    pack_ok = torch.equal(got, want) and bool((buffer[offset + nbytes :] == 0xA5).all())
    unpack_ok = all(torch.equal(raw(a), raw(b)) for a, b in zip(fresh, expect, strict=True))
    return {
        "layout": name,
        "dtype": str(dtype).removeprefix("torch."),
        "blocks": num_ids,
        "head_dim": head_dim,
        "block_size": block_size,
        "segment_bytes": layout.segment_bytes,
        "chunk_offset": offset,
        "pack_exact": pack_ok,
        "unpack_exact": unpack_ok,
    }


def correctness(kernels: kv_cuda.CudaKernels) -> list[dict[str, Any]]:
    """Every layout x dtype, full (16) and partial (5) chunks, plus odd cases."""
    cases = [
        (name, dtype, n, 128, 16, 0)
        for name in LAYOUTS
        for dtype in (torch.bfloat16, torch.float16, fp8_dtype())
        for n in (16, 5)
    ]
    # unaligned chunk buffers (byte-wise path), a partial second 16 KiB tile
    # (18432-byte segments), odd 15-byte segments (unaligned cache blocks)
    cases += [("flash", torch.bfloat16, 7, 128, 16, 1), ("cpu", torch.float16, 7, 72, 16, 0)]
    cases += [("cpu", torch.float16, 7, 72, 16, 8), ("mla", torch.uint8, 6, 5, 3, 0)]
    cases += [("mla", torch.uint8, 6, 5, 3, 3)]
    return [check_case(kernels, *case) for case in cases]


def fold64_cases() -> list[dict[str, Any]]:
    """The fold64 kernel against torch ops on the device (and the plain
    definition where it is fast enough): odd lengths, unaligned starts, a
    chunk-sized buffer, and a VRAM ChunkPool's slot checksum."""
    from fabric.store import ChunkPool

    gen = torch.Generator(device="cuda").manual_seed(5)
    cases = []
    for nbytes in (0, 1, 7, 8, 9, 4097, 1 << 20, (32 << 20) + 3):
        for offset in (0, 1, 3):
            buf = torch.randint(
                0, 256, (nbytes + offset,), dtype=torch.uint8, device="cuda", generator=gen
            )
            data = buf[offset:]
            torch.cuda.synchronize()  # NOTE: fold64 runs on a stream of its own, after nothing
            kernel, ops = fold64(data), int(fold64_tensor(data).item()) & ((1 << 64) - 1)
            exact = kernel == ops
            if nbytes <= 4097:
                exact = exact and kernel == fold64_reference(bytes(data.cpu().tolist()))
            cases.append({"fold64_bytes": nbytes, "offset": offset, "exact": exact})
    pool = ChunkPool(2, 4096, device="cuda")
    pool.slot_view(1).copy_(torch.arange(4096, device="cuda").to(torch.uint8))
    torch.cuda.synchronize()
    want = fold64_reference(bytes(i % 256 for i in range(4000)))
    cases.append({"fold64_pool_slot": True, "exact": pool.checksum(1, 4000) == want})
    pinned = ChunkPool(2, 1 << 20, device="pinned")  # cudaHostRegister of its own pages
    cases.append({"pinned_pool_page_locked": True, "exact": bool(pinned.buffer.is_pinned())})
    return cases


# --- benchmark ------------------------------------------------------------------


@dataclass
class Bench:
    """Llama-3-8B flash caches, a prompt's shuffled blocks in chunks, a store."""

    layout: KVLayout
    caches: list[torch.Tensor]
    chunks: list[np.ndarray]
    store: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.layout.chunk_nbytes(sum(len(c) for c in self.chunks))

    def slot(self, i: int) -> torch.Tensor:
        size = self.layout.chunk_nbytes(CHUNK_TOKENS // BLOCK_SIZE)
        return self.store[i * size : (i + 1) * size]


def build_bench(prompt_tokens: int, pool_factor: float) -> Bench:
    prompt_blocks = prompt_tokens // BLOCK_SIZE
    num_blocks = int(prompt_blocks * pool_factor)
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [
        torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(NUM_LAYERS)
    ]
    layout = KVLayout.from_tensors(caches, model="meta-llama/Meta-Llama-3-8B")
    ids = np.random.default_rng(0).permutation(num_blocks)[:prompt_blocks].astype(np.int64)
    chunks = np.split(ids, prompt_tokens // CHUNK_TOKENS)
    store = torch.zeros(layout.chunk_nbytes(len(ids)), dtype=torch.uint8, device="cuda")
    return Bench(layout, caches, chunks, store)


def paired_gbps(fns: dict[str, Callable[[], None]], nbytes: int, reps: int) -> dict[str, float]:
    """Median GB/s of each fn, timed alternately, wall clock to a device-wide sync."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: round(nbytes / statistics.median(t) / 1e9, 1) for name, t in times.items()}


def direct_tables(bench: Bench) -> tuple[list[torch.Tensor], int, int]:
    """Device launch tables per chunk, built once (no per-call host work)."""
    views = segment_views(bench.caches, bench.layout)
    tables, rows, seg = [], 0, 0
    for ids in bench.chunks:
        host, rows, seg = kv_cuda.launch_table(views, ids)
        tables.append(host.cuda())
    return tables, rows, seg


def benchmark(bench: Bench, extension: Any, reps: int) -> dict[str, Any]:
    tables, rows, seg = direct_tables(bench)
    src = torch.ones(bench.nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    size = bench.slot(0).numel()
    torch_kernels = TorchIndexKernels()
    views = segment_views(bench.caches, bench.layout)

    def direct(fn: Callable[..., None]) -> Callable[[], None]:
        def run() -> None:
            stream = torch.cuda.current_stream().cuda_stream
            for i, t in enumerate(tables):
                fn(t[:rows], t[rows : 2 * rows], t[2 * rows :], bench.slot(i), seg, stream)

        return run

    def d2d() -> None:
        for i in range(len(bench.chunks)):
            dst[i * size : (i + 1) * size].copy_(src[i * size : (i + 1) * size])

    def d2d_one() -> None:
        dst.copy_(src)

    out = torch.empty(1, dtype=torch.int64, device="cuda")

    def fold64_kernel() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(len(bench.chunks)):
            extension.fold64(bench.slot(i), out, stream)

    def api_pack() -> None:
        for i, ids in enumerate(bench.chunks):
            pack(bench.caches, bench.layout, ids, bench.slot(i))

    def api_unpack() -> None:
        for i, ids in enumerate(bench.chunks):
            unpack(bench.slot(i), bench.caches, bench.layout, ids)

    def torch_pack() -> None:
        for i, ids in enumerate(bench.chunks):
            torch_kernels.pack(views, ids, bench.slot(i))

    def torch_unpack() -> None:
        for i, ids in enumerate(bench.chunks):
            torch_kernels.unpack(bench.slot(i), views, ids)

    gbps = paired_gbps(
        {
            "pack_kernel": direct(extension.pack),
            "unpack_kernel": direct(extension.unpack),
            "pack_api": api_pack,
            "unpack_api": api_unpack,
            "pack_torch": torch_pack,
            "unpack_torch": torch_unpack,
            "d2d_per_chunk": d2d,
            "d2d_one_copy": d2d_one,
            "fold64_kernel": fold64_kernel,
        },
        bench.nbytes,
        reps,
    )
    return {"gbps": gbps, "bytes_per_rep": bench.nbytes, "chunks": len(bench.chunks)}


def bench_exact(bench: Bench) -> bool:
    """The packed store of the benchmark equals torch indexing, chunk by chunk."""
    torch.cuda.synchronize()
    views = segment_views(bench.caches, bench.layout)
    want = torch.empty_like(bench.slot(0))
    for i, ids in enumerate(bench.chunks):
        pack(bench.caches, bench.layout, ids, bench.slot(i))
        TorchIndexKernels().pack(views, ids, want)
        torch.cuda.synchronize()
        if not torch.equal(bench.slot(i), want):
            return False
    return True


def push_check(tokens: int, reps: int) -> dict[str, Any]:
    """fabric's full path with its pool in VRAM (fused pack -> fold64 -> NIXL
    WRITE -> fold64 verify -> fused unpack), two processes on this GPU,
    against a raw NIXL VRAM WRITE of the same bytes (``fabric bench
    transfer --memory vram``; Llama-3-8B, 256-token chunks, 4 per WRITE)."""
    try:
        import nixl  # noqa: F401
    except ImportError as exc:
        return {"error": f"nixl does not import ({exc}); bring its wheel (gpu_check.sh)"}
    from fabric.bench.sweep import run_sweep
    from fabric.bench.sweep_plan import Grid, SweepConfig, plan_sweep

    grid = Grid(
        geometries=("llama3-8b",),
        chunk_tokens=(CHUNK_TOKENS,),
        batches=(4,),
        transports=("nixl",),
        memories=("vram",),
        progress=(False,),
    )
    config = SweepConfig(grids=(grid,), tokens=tokens, reps=reps, paths=("raw", "push", "full"))
    result = run_sweep(config, plan_sweep(config, has_cuda=lambda: True))
    if result["errors"] or not result["points"]:
        return {"error": "the sweep failed", "errors": result["errors"]}
    point = result["points"][0]
    gbps = {name: path["gbps"] for name, path in point["paths"].items()}
    return {
        "gbps": gbps,
        "cpu_ms": {name: path.get("cpu_ms") for name, path in point["paths"].items()},
        "bytes": point["bytes"],
        "bytes_match": point["bytes_match"],
        "full_vs_raw": round(gbps["full"] / gbps["raw"], 3),
        "push_vs_raw": round(gbps["push"] / gbps["raw"], 3),
    }


# --- report -----------------------------------------------------------------------


def machine() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "host": platform.node(),
    }


def print_table(gbps: dict[str, float]) -> None:
    print(f"{'variant':<16} {'GB/s':>8} {'vs d2d':>8}")
    base = gbps["d2d_per_chunk"]
    for name, value in gbps.items():
        print(f"{name:<16} {value:>8.1f} {value / base:>8.3f}")
    print("(GB/s of chunk bytes; d2d = torch copy_ of each chunk's bytes, same launches)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    extension = kv_cuda.load_extension()
    if extension is None:
        raise RuntimeError("the fused extension did not load (see the warning above)")
    kernels = kv_cuda.kernels_for("cuda", load=lambda: extension)
    assert isinstance(kernels, kv_cuda.CudaKernels)
    report: dict[str, Any] = {"machine": machine(), "build_s": round(time.perf_counter() - start)}
    print(f"machine: {json.dumps(report['machine'])}; extension ready in {report['build_s']} s")
    cases = correctness(kernels)
    failed = [c for c in cases if not (c["pack_exact"] and c["unpack_exact"])]
    print(f"correctness: {len(cases) - len(failed)}/{len(cases)} cases bit-exact")
    for case in failed:
        print(f"  MISMATCH {json.dumps(case)}")
    sums = fold64_cases()
    bad_sums = [c for c in sums if not c["exact"]]
    print(f"fold64: {len(sums) - len(bad_sums)}/{len(sums)} cases equal torch ops")
    for case in bad_sums:
        print(f"  MISMATCH {json.dumps(case)}")
    report["cases"], report["fold64_cases"] = cases, sums
    summary: dict[str, Any] = {"bit_exact": not failed and not bad_sums}
    if not args.skip_bench:
        bench = build_bench(args.prompt_tokens, args.pool_factor)
        report["bench"] = benchmark(bench, extension, args.reps)
        summary["bit_exact"] = summary["bit_exact"] and bench_exact(bench)
        gbps = report["bench"]["gbps"]
        print_table(gbps)
        summary["pack_vs_d2d"] = round(gbps["pack_kernel"] / gbps["d2d_per_chunk"], 3)
        summary["unpack_vs_d2d"] = round(gbps["unpack_kernel"] / gbps["d2d_per_chunk"], 3)
        summary["fold64_vs_d2d"] = round(gbps["fold64_kernel"] / gbps["d2d_per_chunk"], 3)
    if not args.skip_push:
        push = push_check(args.prompt_tokens, args.push_reps)
        report["push"] = push
        print(f"push (VRAM pool vs raw NIXL VRAM WRITE): {json.dumps(push)}")
        if "error" not in push:
            summary["push_vs_raw_vram"] = push["full_vs_raw"]
            summary["bit_exact"] = summary["bit_exact"] and all(push["bytes_match"].values())
    report["summary"] = summary
    report["total_s"] = round(time.perf_counter() - start)
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_check needs a GPU machine", file=sys.stderr, flush=True)
        empty = {"bit_exact": False, "pack_vs_d2d": None, "unpack_vs_d2d": None}
        print(json.dumps({**empty, "push_vs_raw_vram": None}))
        sys.exit(1)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"gpu-check-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    summary = report["summary"]
    print(
        json.dumps(
            {
                "bit_exact": summary["bit_exact"],
                "pack_vs_d2d": summary.get("pack_vs_d2d"),
                "unpack_vs_d2d": summary.get("unpack_vs_d2d"),
                "push_vs_raw_vram": summary.get("push_vs_raw_vram"),
                "fold64_vs_d2d": summary.get("fold64_vs_d2d"),
            }
        )
    )
    if not summary["bit_exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
