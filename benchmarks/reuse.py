"""Reuse-tier benchmark: TTFT of a repeated long prompt, miss vs hit.

One run, one machine, the tiny KV-heavy Llama (Llama-3-8B KV geometry, 128
KiB of KV per token: a 4k-token prompt is 512 MiB of KV):

    miss        fabric engine, a prompt it never saw: vLLM computes it all
                (and fabric saves its full chunks behind the step)
    hit_mem     the same prompt again: every full chunk loads from the
                store's memory tier; vLLM computes only the tail
    hit_disk    memory tier cleared (``Clear("memory")`` over the control
                channel) and the chunk files dropped from the page cache
                (fsync + ``POSIX_FADV_DONTNEED``): chunks come from disk
    vllm        plain vLLM (no connector), same model and flags: its miss
                TTFT, and its own prefix-cache hit (``vllm_apc_hit``) as the
                in-engine reference

Both engines run with ``--no-enable-prefix-caching`` except the vLLM one,
whose prefix cache is what ``vllm_apc_hit`` measures. They run one after
the other, each with both cores. TTFT is the time to the first streamed
token of a greedy completion (``max_tokens`` 1 .. 2), medians over prompts.

    python benchmarks/reuse.py [--prompts 3] [--tokens 4096]

The last stdout line is one JSON object:
``{"ttft_hit_mem_over_miss": .., "ttft_hit_disk_over_miss": ..}`` -- each
the *speedup* (miss TTFT / hit TTFT), so higher is better; goal: >= 5 for
memory. Results go to ``benchmarks/results/reuse-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from fabric.launch.process import (
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
    wait_http_ok,
)
from fabric.testing.models import make_tiny_model
from fabric.transfer.store_client import StoreClient

ROOT = Path(__file__).resolve().parent
CHUNK_TOKENS = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3, help="distinct prompts (medians)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--cores", default="0-1", help="CPU cores of each engine")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--out", type=Path, default=None, help="result JSON path")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    return parser.parse_args(argv)


class Engine:
    """One vLLM engine started and stopped by pid."""

    def __init__(
        self,
        model_dir: Path,
        workdir: Path,
        name: str,
        cores: str,
        kv_config: dict[str, Any] | None,
        extra_args: list[str],
        timeout: float,
    ) -> None:
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        argv = vllm_serve_command(
            model_dir,
            self.port,
            kv_transfer_config=kv_config,
            extra_args=extra_args,
            served_model_name="tiny",
            max_model_len=8192,  # a 4096-token prompt plus its answer
        )
        env = engine_env(workdir, cpu_cores=cores, kv_cache_gib=3)
        started = time.monotonic()
        self.process = ManagedProcess(
            argv, log_path=workdir / f"{name}.log", env=env, cwd=workdir, name=name
        )
        try:
            wait_http_ok(f"http://127.0.0.1:{self.port}/health", timeout, self.process)
        except BaseException:
            self.process.stop()
            raise
        self.start_s = time.monotonic() - started

    def ttft(self, prompt: list[int]) -> tuple[float, list[int]]:
        """Seconds to the first streamed token, and the generated token ids."""
        payload = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        ids: list[int] = []
        first = None
        started = time.perf_counter()
        url = f"http://127.0.0.1:{self.port}/v1/completions"
        with httpx.stream("POST", url, json=payload, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    if choice.get("token_ids") and first is None:
                        first = time.perf_counter() - started
                    ids += choice.get("token_ids") or []
        assert first is not None, "no token streamed"
        return first, ids

    def metric(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    def stop(self) -> None:
        self.process.stop()


def drop_page_cache(directory: Path) -> int:
    """fsync every chunk file and ask the kernel to drop its cached pages."""
    count = 0
    for path in directory.rglob("*.chunk"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


def wait_files(directory: Path, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(list(directory.rglob("*.chunk"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"disk tier wrote fewer than {count} chunk files in {timeout} s")
        time.sleep(0.2)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    load_start = os.getloadavg()[0]
    model_dir = make_tiny_model(workdir / "model", kv_heavy=True)
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 500) for _ in range(args.tokens)] for _ in range(args.prompts)]
    full_chunks = (args.tokens - 1) // CHUNK_TOKENS
    disk = workdir / "disk"
    kv_port = free_port()
    kv_config = {
        "kv_connector": "FabricConnector",
        "kv_connector_module_path": "fabric.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "kv_port": kv_port,
            "chunk_tokens": CHUNK_TOKENS,
            "store_mib": 1200,
            "disk_path": str(disk),
            "disk_gib": 8,
        },
    }
    samples: dict[str, list[float]] = {k: [] for k in ("miss", "hit_mem", "hit_disk")}
    samples |= {"vllm": [], "vllm_apc_hit": []}
    print(f"fabric engine (kv_both, disk tier at {disk}) ...", flush=True)
    fabric = Engine(
        model_dir,
        workdir / "fabric",
        "fabric",
        args.cores,
        kv_config,
        ["--no-enable-prefix-caching"],
        args.start_timeout,
    )
    outputs: dict[str, list[list[int]]] = {"fabric": [], "vllm": []}
    loads_before = fabric.metric("vllm:fabric_store_hit_chunks_total")
    try:
        fabric.ttft([1, 2, 3])  # warm-up
        with StoreClient(f"tcp://127.0.0.1:{kv_port}", timeout_ms=60_000) as store:
            for i, prompt in enumerate(prompts):
                miss, ids = fabric.ttft(prompt)
                wait_files(disk, args.tokens // CHUNK_TOKENS * (i + 1))
                hit, ids_mem = fabric.ttft(prompt)
                store.clear("memory")
                dropped = drop_page_cache(disk)
                hit_disk, ids_disk = fabric.ttft(prompt)
                assert ids == ids_mem == ids_disk, "a hit changed the output"
                outputs["fabric"].append(ids)
                samples["miss"].append(miss)
                samples["hit_mem"].append(hit)
                samples["hit_disk"].append(hit_disk)
                print(
                    f"  prompt {i}: miss {miss:.3f} s, hit mem {hit:.3f} s, "
                    f"hit disk {hit_disk:.3f} s ({dropped} files dropped from the page cache)",
                    flush=True,
                )
        loaded = fabric.metric("vllm:fabric_store_hit_chunks_total") - loads_before
    finally:
        fabric.stop()
    print("plain vLLM engine (no connector, prefix cache on) ...", flush=True)
    vllm = Engine(model_dir, workdir / "vllm", "vllm", args.cores, None, [], args.start_timeout)
    try:
        vllm.ttft([1, 2, 3])
        for i, prompt in enumerate(prompts):
            first, ids = vllm.ttft(prompt)
            again, _ = vllm.ttft(prompt)
            samples["vllm"].append(first)
            samples["vllm_apc_hit"].append(again)
            outputs["vllm"].append(ids)
            print(f"  prompt {i}: vllm {first:.3f} s, vllm prefix-cache hit {again:.3f} s")
    finally:
        vllm.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "benchmark": "reuse",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "loadavg_start_end": [load_start, os.getloadavg()[0]],
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "settings": {
            "model": "tiny-kv-heavy (32 layers x 8 KV heads x 128, bf16, 128 KiB/token)",
            "prompt_tokens": args.tokens,
            "prompts": args.prompts,
            "chunk_tokens": CHUNK_TOKENS,
            "full_chunks_loaded_per_hit": full_chunks,
            "cores": args.cores,
            "kv_bytes_per_prompt": args.tokens * 128 * 1024,
        },
        "ttft_s_median": med,
        "samples_s": samples,
        "store_hit_chunks": loaded,
        "same_tokens_as_vllm": outputs["fabric"] == outputs["vllm"],
        "ttft_hit_mem_over_miss": med["miss"] / med["hit_mem"],
        "ttft_hit_disk_over_miss": med["miss"] / med["hit_disk"],
        "ttft_miss_over_vllm": med["miss"] / med["vllm"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="fabric-reuse-") as tmp:
            result = run(args, Path(tmp))
    else:
        result = run(args, args.workdir)
    med = result["ttft_s_median"]
    print()
    print(f"{'case':<14} {'TTFT median':>12} {'vs miss':>9}")
    for case in ("miss", "hit_mem", "hit_disk", "vllm", "vllm_apc_hit"):
        print(f"{case:<14} {med[case]:>10.3f} s {med['miss'] / med[case]:>8.1f}x")
    print(f"same tokens as plain vLLM: {result['same_tokens_as_vllm']}")
    day = datetime.date.today().isoformat()
    out = args.out or ROOT / "results" / f"reuse-{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    summary = {
        "ttft_hit_mem_over_miss": round(result["ttft_hit_mem_over_miss"], 2),
        "ttft_hit_disk_over_miss": round(result["ttft_hit_disk_over_miss"], 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
