"""Transfer benchmark: the same KV bytes between two processes, four ways.

    memcpy   torch copy_ of the same bytes in one process (context)
    raw      one NIXL WRITE of one contiguous region (the ceiling)
    page     one NIXL WRITE with one descriptor per 16-token block per layer
             per K/V region, prepared lists (what vLLM's NixlConnector posts)
    push     fabric: Reserve + WRITE of packed store slots + notify, until the
             receiver verified every chunk's checksum
    full     fabric: pack each chunk, push it, unpack it on the receiver,
             pipelined per chunk, until the receiver's cache holds every block

Every path is timed from the sender's first call until the receiver knows
the bytes are there (its notification, or its verification/unpack), so the
receiver's steady-rate polling is part of every number. The sender here is
this process; the receiver is ``fabric.bench.transfer_side`` in a child.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from fabric.bench.rawnixl import descs
from fabric.bench.transfer_side import BenchSide, SideArgs, side_args_json
from fabric.kv import pack
from fabric.transfer.client import PendingPush


class Receiver:
    """The child process and its command pipe."""

    def __init__(self, args: SideArgs) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fabric.bench.transfer_side", side_args_json(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark receiver exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def send(self, *words: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.send("quit")
            self.proc.wait(timeout=30)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class Suite:
    """Sender side of one benchmark run (one progress-thread setting)."""

    def __init__(self, args: SideArgs) -> None:
        self.side = BenchSide(replace(args, seed=1, tag=f"p{int(args.progress_thread)}"))
        self.rx = Receiver(replace(args, seed=2, tag=f"d{int(args.progress_thread)}"))
        hello = self.rx.hello
        self.peer = self.side.raw.add_peer(bytes.fromhex(hello["raw_metadata"]))
        self.link = self.side.node.client.connect(hello["endpoint"])
        self.remote_pool = int(hello["pool_base"])
        remote_ids = np.asarray(hello["block_ids"], dtype=np.int64)
        s = self.side
        self.local_pages = s.raw.prep(s.page_descs(s.kv_base))
        self.remote_pages = s.raw.prep(s.page_descs(int(hello["kv_base"])), self.peer)
        rows = np.arange(s.layout.num_layers * s.layout.segments, dtype=np.int64)
        self.local_idx = s.page_indices()
        self.remote_idx = (rows[:, None] * s.num_blocks + remote_ids[None, :]).reshape(-1)
        self._rid = 0

    def next_rid(self) -> str:
        self._rid += 1
        return f"bench-{self._rid}"

    def keys(self, rid: str) -> list[bytes]:
        return [f"{rid}:{i}".encode().ljust(16, b".")[:16] for i in range(self.side.num_chunks)]

    def time_raw(self) -> float:
        s = self.side
        local = descs(np.array([s.store.pool.base_address]), s.total_bytes)
        remote = descs(np.array([self.remote_pool]), s.total_bytes)
        self.rx.send("raw", 1)
        t0 = time.perf_counter()
        s.raw.wait(s.raw.write(self.peer, local, remote, b"raw"))
        self.rx.read()
        return time.perf_counter() - t0

    def time_page(self) -> float:
        s = self.side
        self.rx.send("raw", 1)
        t0 = time.perf_counter()
        handle = s.raw.prepped_write(
            self.local_pages, self.local_idx, self.remote_pages, self.remote_idx, b"page"
        )
        s.raw.wait(handle)
        self.rx.read()
        return time.perf_counter() - t0

    def time_push(self) -> tuple[float, float]:
        """Seconds until every chunk landed (notified), and until verified."""
        s = self.side
        rid = self.next_rid()
        keys, slots = self.keys(rid), []
        for i, key in enumerate(keys):  # packed ahead, outside the timing
            slot = s.store.allocate(key)
            pack(s.views, s.layout, s.chunk_block_ids(i), s.store.pool.slot_view(slot))
            s.store.commit(slot, key, s.slot_bytes)
            slots.append(slot)
        self.rx.send("fabric", rid)
        t0 = time.monotonic()
        res = self.link.reserve(rid, keys, [s.slot_bytes] * len(keys))
        pushes = [self.link.write(res, [i], [slot]) for i, slot in enumerate(slots)]
        wait_all(pushes)
        out = self.rx.read()
        assert out["complete"], out
        return out["landed_at"] - t0, out["verified_at"] - t0

    def time_full(self) -> float:
        s = self.side
        rid = self.next_rid()
        keys = self.keys(rid)
        self.rx.send("full", rid, len(keys))
        t0 = time.perf_counter()
        res = self.link.reserve(rid, keys, [s.slot_bytes] * len(keys))
        pushes: list[PendingPush] = []
        for i, key in enumerate(keys):
            slot = s.store.allocate(key)
            pack(s.views, s.layout, s.chunk_block_ids(i), s.store.pool.slot_view(slot))
            s.store.commit(slot, key, s.slot_bytes)
            pushes.append(self.link.write(res, [i], [slot]))
            pushes = [p for p in pushes if not p.done()]
        wait_all(pushes)
        assert self.rx.read()["complete"]
        return time.perf_counter() - t0

    def digests_match(self) -> bool:
        self.rx.send("digest")
        return bool(self.rx.read()["digest"] == self.side.digest())

    def close(self) -> None:
        self.link.close()
        self.rx.close()
        self.side.close()


def wait_all(pushes: list[PendingPush], timeout: float = 120) -> None:
    for push in pushes:
        push.wait(timeout)


def time_memcpy(nbytes: int, reps: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_suite(args: SideArgs, reps: int) -> dict[str, Any]:
    """Median seconds per path, GB/s and the correctness checks."""
    suite = Suite(args)
    try:
        timers: dict[str, Any] = {
            "raw": suite.time_raw,
            "page": suite.time_page,
            "push": suite.time_push,
            "full": suite.time_full,
        }
        times: dict[str, list[float]] = {name: [] for name in [*timers, "push_verified"]}
        checks = {}
        for name, fn in timers.items():
            fn()  # warm-up: first touch, connection setup
            for _ in range(reps):
                t = fn()
                if name == "push":
                    times["push"].append(t[0])
                    times["push_verified"].append(t[1])
                else:
                    times[name].append(t)
            if name in ("page", "full"):
                checks[name] = suite.digests_match()
        nbytes = suite.side.total_bytes
    finally:
        suite.close()
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "progress_thread": args.progress_thread,
        "bytes": nbytes,
        "seconds": medians,
        "gbps": {name: nbytes / t / 1e9 for name, t in medians.items()},
        "bytes_match": checks,
    }


def run(args: SideArgs, reps: int, progress_modes: list[bool]) -> dict[str, Any]:
    import platform

    import torch

    nbytes = args.tokens * _bytes_per_token(args)
    memcpy = time_memcpy(nbytes, reps)
    suites = [run_suite(replace(args, progress_thread=mode), reps) for mode in progress_modes]
    return {
        "benchmark": "transfer",
        "args": asdict(args),
        "reps": reps,
        "machine": {
            "cpus": __import__("os").cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "memcpy_gbps": nbytes / memcpy / 1e9,
        "suites": suites,
    }


def _bytes_per_token(args: SideArgs) -> int:
    from fabric.bench.geometry import preset

    return preset(args.geometry).bytes_per_token


def headline(result: dict[str, Any]) -> dict[str, float]:
    """Ratios of the default setting (progress thread off, else the first)."""
    suites = result["suites"]
    suite = next((s for s in suites if not s["progress_thread"]), suites[0])
    g = suite["gbps"]
    return {
        "push_vs_raw": round(g["push"] / g["raw"], 3),
        "push_verified_vs_raw": round(g["push_verified"] / g["raw"], 3),
        "full_vs_raw": round(g["full"] / g["raw"], 3),
        "full_vs_page": round(g["full"] / g["page"], 3),
    }


def print_report(result: dict[str, Any]) -> None:
    args = result["args"]
    print(
        f"{args['geometry']}: {result['suites'][0]['bytes'] / 2**20:.0f} MiB per transfer, "
        f"{args['chunk_tokens']}-token chunks, {args['block_size']}-token blocks, "
        f"memcpy {result['memcpy_gbps']:.2f} GB/s"
    )
    print(f"{'progress thread':<16}{'path':<8}{'GB/s':>8}{'ms':>9}{'vs raw':>8}{'bytes ok':>10}")
    for suite in result["suites"]:
        raw = suite["gbps"]["raw"]
        mode = "on" if suite["progress_thread"] else "off"
        for path, gbps in suite["gbps"].items():
            ok = suite["bytes_match"].get(path, "")
            ms = suite["seconds"][path] * 1e3
            print(f"{mode:<16}{path:<8}{gbps:>8.2f}{ms:>9.1f}{gbps / raw:>8.2f}{ok!s:>10}")


def main(argv: list[str] | None = None, results_dir: Path = Path("benchmarks/results")) -> None:
    """``fabric bench transfer`` / ``python benchmarks/transfer.py``."""
    parser = argparse.ArgumentParser(
        prog="fabric bench transfer", description="KV transfer bandwidth, fabric vs NIXL"
    )
    parser.add_argument("--geometry", default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--progress", choices=["off", "on", "both"], default="both")
    parser.add_argument("--out", type=Path, default=None, help="JSON result path")
    ns = parser.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    modes = {"off": [False], "on": [True], "both": [False, True]}[ns.progress]
    args = SideArgs(geometry=ns.geometry, tokens=ns.tokens, chunk_tokens=ns.chunk_tokens)
    result = run(args, ns.reps, modes)
    result["headline"] = headline(result)
    print_report(result)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ns.out or results_dir / f"transfer-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    print(json.dumps(result["headline"]))
