"""Transfer benchmark: the same KV bytes between two processes, several ways.

    memcpy   torch copy_ of the same bytes in one process (context)
    raw      NIXL WRITEs of contiguous regions (the ceiling): one per batch
             of chunks, or one for the whole transfer (``raw_whole``)
    page     NIXL WRITEs with one descriptor per 16-token block per layer
             per K/V region, prepared lists (what vLLM's NixlConnector posts)
    push     fabric: Reserve + WRITE of packed store slots + notify, until the
             receiver verified every chunk's checksum (packed beforehand)
    full     fabric: pack each chunk, push it, unpack it on the receiver,
             pipelined (:mod:`fabric.bench.fullpath`), until the receiver's
             cache holds every block and every chunk is verified (staged)
    direct   fabric's direct path (:mod:`fabric.kv.direct`): the receiver
             READs each chunk's blocks out of the sender's cache into its
             own (one descriptor per piece, merged where both sides are
             contiguous) while the sender hashes its chunks in place, then
             hashes its own blocks and compares, until every chunk is
             verified; NIXL and host memory only

Every path is timed from the sender's first call until the receiver knows
the bytes are there (its notification, or its verification/unpack), so the
receiver's steady-rate polling is part of every number. The sender here is
this process; the receiver is ``fabric.bench.transfer_side`` in a child.
:class:`Suite` is one receiver (one geometry, memory kind and progress
setting); :mod:`fabric.bench.sweep` runs many. ``main`` is the fixed
single-point benchmark of ``benchmarks/transfer.py``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fabric.bench.fullpath import FullPathOptions, FullPathSender
from fabric.bench.rawnixl import descs
from fabric.bench.transfer_side import BenchSide, SideArgs, side_args_json
from fabric.errors import TransferError
from fabric.kv import pack
from fabric.kv.direct import cache_map
from fabric.kv.pack import settle
from fabric.transfer.client import PendingPush

_suite_ids = itertools.count(1)


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

    def read(self, drive: Callable[[], object] | None = None) -> dict[str, Any]:
        """The child's next answer; with ``drive``, called every ms from a
        thread until it comes (this side's NIXL agent answers the reader's
        connection and takes its notifications, as a server's steady polling
        would)."""
        assert self.proc.stdout is not None
        if drive is None:
            line = self.proc.stdout.readline()
        else:
            stop = threading.Event()

            def driving() -> None:
                while not stop.wait(1e-3):
                    drive()

            driver = threading.Thread(target=driving, name="bench-drive", daemon=True)
            driver.start()
            try:
                line = self.proc.stdout.readline()
            finally:
                stop.set()
                driver.join()
        if not line:
            raise RuntimeError(f"benchmark receiver exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def send(self, *words: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()

    def ask(self, *words: object) -> dict[str, Any]:
        self.send(*words)
        return self.read()

    def close(self) -> None:
        try:
            self.send("quit")
            self.proc.wait(timeout=30)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class Suite:
    """Sender side of one cache (geometry, memory kind, progress setting) and its receiver.

    Path timers take ``batch`` (chunks per WRITE) and ``count`` (chunks moved,
    from chunk 0) and return seconds; ``use_fabric`` picks the chunk size and
    fabric's transport for the next calls.
    """

    def __init__(self, args: SideArgs, options: FullPathOptions | None = None) -> None:
        tag = f"s{next(_suite_ids)}p{int(args.progress_thread)}"
        self.options = options or FullPathOptions()
        self.side = BenchSide(replace(args, seed=1, tag=f"{tag}-tx"), serve=False)
        self.rx: Receiver | None = None
        self._scratch: Any = None
        self._direct_plane: Any = None
        self.direct_reader: str | None = None
        """How the receiver read on the direct path's last run (``reader_used``)."""
        self._rid = 0
        try:
            self.rx = Receiver(replace(args, seed=2, tag=f"{tag}-rx"))
            self._connect(self.receiver.hello)
        except BaseException:
            self.close()
            raise
        self.sender = FullPathSender(self.side, self.options)

    def _connect(self, hello: dict[str, Any]) -> None:
        """Raw NIXL peer, prepared page lists and fabric link to the receiver."""
        s = self.side
        self.peer = s.raw.add_peer(bytes.fromhex(hello["raw_metadata"]))
        self.remote_kv = int(hello["kv_base"])
        self.remote_ids = np.asarray(hello["block_ids"], dtype=np.int64)
        self.local_pages = s.raw.prep(s.page_descs(s.kv_base))
        self.remote_pages = s.raw.prep(s.page_descs(self.remote_kv), self.peer)
        self.link = s.end.node.client.connect(hello["endpoint"])

    @property
    def receiver(self) -> Receiver:
        assert self.rx is not None
        return self.rx

    # ------------------------------------------------------------ setup
    def use_fabric(self, transport: str, chunk_tokens: int) -> None:
        end = self.side.end
        if (end.transport, end.chunk_tokens) == (transport, chunk_tokens):
            return
        endpoint = self.receiver.ask("fabric", transport, chunk_tokens)["endpoint"]
        self.side.use_fabric(transport, chunk_tokens)
        self.link = self.side.end.node.client.connect(endpoint)

    @property
    def num_chunks(self) -> int:
        return self.side.end.num_chunks

    def chunk_bytes(self, index: int) -> int:
        s = self.side
        return s.layout.chunk_nbytes(len(s.chunk_block_ids(s.end.chunk_blocks, index)))

    def moved_bytes(self, count: int) -> int:
        return sum(self.chunk_bytes(i) for i in range(count))

    def next_rid(self) -> str:
        self._rid += 1
        return f"bench-{self._rid}"

    def keys(self, rid: str, count: int) -> list[bytes]:
        return [f"{rid}:{i}".encode().ljust(16, b".")[:16] for i in range(count)]

    def batches(self, batch: int, count: int) -> list[range]:
        return [range(s, min(s + batch, count)) for s in range(0, count, batch)]

    # ------------------------------------------------------------ paths
    def time_memcpy(self, batch: int, count: int) -> float:
        """Copy the same bytes, ``batch`` chunks per copy, within this process.

        NOTE: numpy's single-threaded copy on the CPU: torch's ``copy_`` splits
        large copies over its thread pool, whose barrier stalls for tens of ms
        when another process holds the second core.
        """
        import torch

        cpu = self.side.device == "cpu"
        src: Any = self.side.storage.view(-1).view(torch.uint8)
        dst: Any = self._scratch_buffer()
        if cpu:
            src, dst = src.numpy(), dst.numpy()
        spans = [sum(self.chunk_bytes(i) for i in b) for b in self.batches(batch, count)]
        t0 = time.perf_counter()
        offset = 0
        for n in spans:
            if cpu:
                np.copyto(dst[offset : offset + n], src[offset : offset + n])
            else:
                dst[offset : offset + n].copy_(src[offset : offset + n])
            offset += n
        if not cpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def time_raw(self, batch: int, count: int) -> float:
        """Contiguous WRITEs of ``batch`` chunks' bytes, all posted, then awaited."""
        s = self.side
        spans, offset = [], 0
        for b in self.batches(batch, count):
            n = sum(self.chunk_bytes(i) for i in b)
            spans.append((offset, n))
            offset += n
        dev = s.device_id
        self.receiver.send("raw", len(spans))
        t0 = time.perf_counter()
        handles = [
            s.raw.write(
                self.peer,
                descs(np.array([s.kv_base + off]), n, dev),
                descs(np.array([self.remote_kv + off]), n, dev),
                b"raw",
            )
            for off, n in spans
        ]
        for handle in handles:
            s.raw.wait(handle)
        self.receiver.read()
        return time.perf_counter() - t0

    def time_page(self, batch: int, count: int) -> float:
        """One WRITE per batch with one descriptor per block per layer per K/V."""
        s = self.side
        chunk_blocks = s.end.chunk_blocks
        plans = []
        for b in self.batches(batch, count):
            lo, hi = b.start * chunk_blocks, min(b.stop * chunk_blocks, s.used_blocks)
            plans.append(
                (s.page_indices(s.block_ids[lo:hi]), s.page_indices(self.remote_ids[lo:hi]))
            )
        self.receiver.send("raw", len(plans))
        t0 = time.perf_counter()
        handles = [
            s.raw.prepped_write(self.local_pages, li, self.remote_pages, ri, b"page")
            for li, ri in plans
        ]
        for handle in handles:
            s.raw.wait(handle)
        self.receiver.read()
        return time.perf_counter() - t0

    @property
    def direct(self) -> bool:
        """Whether the direct path runs at the current setting."""
        return self.side.end.direct

    def time_direct(self, batch: int, count: int) -> float:
        """Receiver READs ``batch`` chunks per READ and verifies each against
        the checksums this side computes meanwhile (hashed in place)."""
        s, end = self.side, self.side.end
        if self._direct_plane is not end.node.plane:
            ids = ",".join(map(str, s.block_ids.tolist()))
            desc = end.node.plane.descriptor().hex()
            regions = end.node.plane.region_descriptor(self.link.peer_agent).hex()
            cmap = msgspec.msgpack.encode(cache_map(s.views, s.layout)).hex()
            out = self.receiver.ask("direct-peer", desc, cmap, ids, regions)
            if "error" in out:
                raise TransferError(out["error"])
            self._direct_plane = end.node.plane
        self.receiver.send("direct", count, batch)
        t0 = time.perf_counter()
        for i in range(count):  # NOTE: each as soon as hashed: the receiver verifies meanwhile
            self.receiver.send("sum", i, s.chunk_checksum(i))
        out = self.receiver.read(drive=end.node.plane.take_notifs)
        if not out.get("complete"):
            raise TransferError(f"the direct path did not verify every chunk: {out}")
        self.direct_reader = str(out.get("reader"))
        return time.perf_counter() - t0

    def time_push(self, batch: int, count: int) -> tuple[float, float]:
        """Seconds until every chunk landed (notified), and until verified."""
        s, end = self.side, self.side.end
        rid = self.next_rid()
        keys, slots = self.keys(rid, count), []
        for i, key in enumerate(keys):  # packed ahead, outside the timing
            slot = end.store.allocate(key)
            n = pack(
                s.views,
                s.layout,
                s.chunk_block_ids(end.chunk_blocks, i),
                end.store.pool.slot_view(slot),
            )
            settle(end.store.pool.slot_view(slot).device)  # NOTE: VRAM: copies before hashing
            end.store.commit(slot, key, n)
            slots.append(slot)
        self.receiver.send("fabric-wait", rid)
        t0 = time.monotonic()
        res = self.link.reserve(rid, keys, [self.chunk_bytes(i) for i in range(count)])
        pushes = [
            self.link.write(res, b, [slots[i] for i in b]) for b in self.batches(batch, count)
        ]
        wait_all(pushes)
        out = self.receiver.read()
        _check_complete(out, rid)
        return out["landed_at"] - t0, out["verified_at"] - t0

    def time_full(self, batch: int, count: int) -> float:
        """Pack, reserve, write, notify, verify and unpack ``count`` chunks."""
        rid = self.next_rid()
        keys = self.keys(rid, count)
        opts = self.options
        self.receiver.send("full", rid, count, opts.unpack_when, opts.unpack_threads)
        t0 = time.perf_counter()
        self.sender.run(self.link, rid, keys, batch)
        out = self.receiver.read()
        _check_complete(out, rid)
        return time.perf_counter() - t0

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time used so far by this process and by the receiver (all threads)."""
        return time.process_time(), float(self.receiver.ask("cpu")["cpu"])

    def digests_match(self) -> bool:
        return bool(self.receiver.ask("digest")["digest"] == self.side.digest())

    def _scratch_buffer(self) -> Any:
        if self.side.device == "cpu":
            return self.side.end.store.pool.buffer
        if self._scratch is None:
            import torch

            self._scratch = torch.empty(self.side.total_bytes, dtype=torch.uint8, device="cuda")
        return self._scratch

    def close(self) -> None:
        if getattr(self, "sender", None) is not None:
            self.sender.close()
        if self.rx is not None:
            self.receiver.close()
            self.rx = None
        self.side.close()


def _check_complete(out: dict[str, Any], rid: str) -> None:
    if not out.get("complete"):
        raise TransferError(f"receiver did not get every chunk of {rid}: {out}")


def wait_all(pushes: list[PendingPush], timeout: float = 120) -> None:
    for push in pushes:
        push.wait(timeout)


def repeat(fn: Callable[[], Any], reps: int) -> list[Any]:
    """``fn()`` once to warm up (first touch, connection setup), then ``reps`` times."""
    fn()
    return [fn() for _ in range(reps)]


def median(values: list[float]) -> float:
    return float(statistics.median(values))


# ---------------------------------------------------------------- single point
def run_suite(suite: Suite, reps: int) -> dict[str, Any]:
    """The fixed benchmark: whole-transfer raw and page WRITEs, chunked push and full."""
    n = suite.num_chunks
    times: dict[str, list[float]] = {"raw": repeat(lambda: suite.time_raw(n, n), reps)}
    suite.receiver.ask("clear")
    times["page"] = repeat(lambda: suite.time_page(n, n), reps)
    checks = {"page": suite.digests_match()}
    push = repeat(lambda: suite.time_push(1, n), reps)
    times["push"] = [p[0] for p in push]
    suite.receiver.ask("clear")
    times["full"] = repeat(lambda: suite.time_full(1, n), reps)
    checks["full"] = suite.digests_match()
    times["push_verified"] = [p[1] for p in push]
    nbytes = suite.side.total_bytes
    medians = {name: median(ts) for name, ts in times.items()}
    return {
        "progress_thread": suite.side.args.progress_thread,
        "bytes": nbytes,
        "seconds": medians,
        "gbps": {name: nbytes / t / 1e9 for name, t in medians.items()},
        "bytes_match": checks,
    }


def time_memcpy(nbytes: int, reps: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return median(repeat(lambda: _timed_copy(dst, src), reps))


def _timed_copy(dst: Any, src: Any) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def machine_info() -> dict[str, Any]:
    import platform

    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg": list(os.getloadavg()),
    }


def run(args: SideArgs, reps: int, progress_modes: list[bool]) -> dict[str, Any]:
    from fabric.bench.geometry import preset

    nbytes = args.tokens * preset(args.geometry).bytes_per_token
    memcpy = time_memcpy(nbytes, reps)
    suites = []
    for mode in progress_modes:
        suite = Suite(replace(args, progress_thread=mode))
        try:
            suites.append(run_suite(suite, reps))
        finally:
            suite.close()
    return {
        "benchmark": "transfer",
        "args": asdict(args),
        "full_path": FullPathOptions().model_dump(),
        "reps": reps,
        "machine": machine_info(),
        "memcpy_gbps": nbytes / memcpy / 1e9,
        "suites": suites,
    }


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
    print(f"{'progress thread':<16}{'path':<15}{'GB/s':>8}{'ms':>9}{'vs raw':>8}{'bytes ok':>10}")
    for suite in result["suites"]:
        raw = suite["gbps"]["raw"]
        mode = "on" if suite["progress_thread"] else "off"
        for path, gbps in suite["gbps"].items():
            ok = suite["bytes_match"].get(path, "")
            ms = suite["seconds"][path] * 1e3
            print(f"{mode:<16}{path:<15}{gbps:>8.2f}{ms:>9.1f}{gbps / raw:>8.2f}{ok!s:>10}")


def main(argv: list[str] | None = None, results_dir: Path = Path("benchmarks/results")) -> None:
    """``python benchmarks/transfer.py``: one geometry and chunk size, both progress modes."""
    parser = argparse.ArgumentParser(
        prog="benchmarks/transfer.py", description="KV transfer bandwidth, fabric vs NIXL"
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
