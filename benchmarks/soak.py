"""Soak: 2P2D under steady load, watching for errors, leaked slots and growth.

Starts ``fabric up`` (a child process: proxy + 4 tiny-model engines, 2P2D)
on free ports, sends ``--requests`` mixed completions (non-streamed and
streamed, prompt lengths 50..1500 tokens, a quarter of them sharing a long
prefix so the reuse tier is exercised) at ``--concurrency``, and samples the
resident memory (RSS) of the proxy process and of every engine's process
tree every ``--sample-s`` seconds. Afterwards it asks every engine's store
over its control channel how many slots are still reserved (must be 0) and
checks the proxy's counters.

Pass criteria (printed, recorded, and the exit code): zero errors, zero
reserved slots left, and proxy and engine RSS after warm-up (the first
``--warmup`` requests) within ``--rss-tolerance`` (10%) of their value at
the end of warm-up.

    python benchmarks/soak.py [--requests 2000] [--concurrency 32]

Not part of CI's default run (it takes ~10-30 minutes on 2 cores). Results go
to ``benchmarks/results/soak-<date>.json``; the last stdout line is a JSON
summary.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from fabric.launch.process import free_port
from fabric.transfer.lookup import StoreClient

ROOT = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def topology(workdir: Path) -> dict[str, Any]:
    engine = {"kv_cache_gib": 1}
    return {
        "model": "tiny",
        "workdir": str(workdir),
        "startup_timeout_s": 900,
        "prefill": [{**engine, "name": f"prefill-{i}", "cpu_cores": str(i)} for i in (0, 1)],
        "decode": [{**engine, "name": f"decode-{i}", "cpu_cores": str(i)} for i in (0, 1)],
        "proxy": {"port": free_port(), "policy": "least_outstanding", "health_interval_s": 5},
        "connector": {
            "chunk_tokens": 256,
            "store_mib": 128,
            "load_timeout_s": 20,
            "extra": {"lease_ms": 20000},
        },
    }


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            with open(f"/proc/{current}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total


def own_rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_prompts(count: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 500) for _ in range(1024)]
    prompts = []
    for _ in range(count):
        tail = [rng.randrange(5, 500) for _ in range(rng.randrange(50, 500))]
        prompts.append(shared + tail if rng.random() < 0.25 else tail * rng.randrange(1, 4))
    return prompts


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, stream: bool
) -> str | None:
    """None when the answer is complete, else what went wrong."""
    payload = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    try:
        if not stream:
            response = await client.post(url, json=payload)
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.text[:200]}"
            return None if response.json()["choices"][0]["text"] is not None else "no text"
        got_done = False
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    got_done = True
                elif line.startswith("data: ") and '"error"' in line:
                    return f"stream error: {line[:200]}"
        return None if got_done else "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


async def drive(
    proxy_url: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    sample: Any,
) -> tuple[list[str], list[float]]:
    url = proxy_url + "/v1/completions"
    errors: list[str] = []
    latencies: list[float] = []
    queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    done = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while True:
            try:
                index, prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            started = time.perf_counter()
            error = await one_request(client, url, prompt, args.max_tokens, index % 2 == 1)
            latencies.append(time.perf_counter() - started)
            if error is not None:
                errors.append(f"request {index}: {error}")
            done += 1
            if done == args.warmup:
                sample("warmup")
            if done % 100 == 0:
                print(f"  {done}/{len(prompts)} done, {len(errors)} errors", flush=True)

    async def sampler() -> None:
        while True:
            await asyncio.sleep(args.sample_s)
            sample("run")

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as client:
        task = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        finally:
            task.cancel()
    return errors, latencies


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    config = workdir / "soak.yaml"
    config.write_text(yaml.safe_dump(topology(workdir)))
    log = open(workdir / "up.log", "w")  # noqa: SIM115 - closed in finally
    up = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", "up", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    state_path = workdir / "run" / "up.json"
    samples: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 1200
        while not state_path.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fabric up did not come up; see {workdir / 'up.log'}")
            time.sleep(1)
        state = json.loads(state_path.read_text())
        proxy_url = state["proxy_url"]
        engines = state["engines"]
        print(f"2P2D up at {proxy_url}; {args.requests} requests at c={args.concurrency}")

        def sample(phase: str) -> None:
            samples.append(
                {
                    "t": time.time(),
                    "phase": phase,
                    "proxy_rss": own_rss(up.pid),
                    "engines_rss": {e["name"]: tree_rss(e["pid"]) for e in engines},
                }
            )

        sample("start")
        started = time.monotonic()
        errors, latencies = asyncio.run(drive(proxy_url, make_prompts(args.requests), args, sample))
        elapsed = time.monotonic() - started
        sample("end")
        time.sleep(3)  # let the last releases land
        reserved = {}
        for engine in engines:
            with StoreClient(engine["kv_endpoint"], timeout_ms=5000) as store:
                reserved[engine["name"]] = store.stats().get("reserved", -1)
        metrics = httpx.get(proxy_url + "/metrics", timeout=10).text
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
    return summarize(args, samples, errors, latencies, elapsed, reserved, metrics)


def summarize(
    args: argparse.Namespace,
    samples: list[dict[str, Any]],
    errors: list[str],
    latencies: list[float],
    elapsed: float,
    reserved: dict[str, int],
    metrics: str,
) -> dict[str, Any]:
    warm = next((s for s in samples if s["phase"] == "warmup"), samples[0])
    after = [s for s in samples if s["t"] >= warm["t"]]
    growth = {"proxy": max(s["proxy_rss"] for s in after) / warm["proxy_rss"] - 1}
    for name, base in warm["engines_rss"].items():
        growth[name] = max(s["engines_rss"][name] for s in after) / base - 1
    counters = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("fabric_proxy_") and line.split()[0].endswith("_total")
    }
    latencies.sort()
    ok = (
        not errors
        and all(v == 0 for v in reserved.values())
        and all(g <= args.rss_tolerance for g in growth.values())
    )
    return {
        "benchmark": "soak",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count()},
        "passed": ok,
        "requests": args.requests,
        "errors": len(errors),
        "first_errors": errors[:10],
        "elapsed_s": elapsed,
        "rps": args.requests / elapsed,
        "latency_s": {
            "p50": latencies[len(latencies) // 2],
            "p99": latencies[int(len(latencies) * 0.99) - 1],
        },
        "reserved_slots_after": reserved,
        "rss_growth_after_warmup": growth,
        "proxy_counters": counters,
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # NOTE: SIGTERM unwinds like Ctrl-C, so `fabric up` and its engines are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="fabric-soak-") as tmp:
            result = run(args, Path(tmp))
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args, args.workdir)
    day = datetime.date.today().isoformat()
    out = args.out or ROOT / "results" / f"soak-{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    growth = {k: f"{v:+.1%}" for k, v in result["rss_growth_after_warmup"].items()}
    print(f"errors {result['errors']}, reserved after {result['reserved_slots_after']}")
    print(f"RSS growth after warm-up: {growth}")
    print(f"{result['rps']:.1f} req/s, p50 {result['latency_s']['p50']:.3f} s; wrote {out}")
    summary = {
        "passed": result["passed"],
        "errors": result["errors"],
        "leaked_slots": sum(max(v, 0) for v in result["reserved_slots_after"].values()),
        "max_rss_growth": round(max(result["rss_growth_after_warmup"].values()), 4),
    }
    print(json.dumps(summary))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
