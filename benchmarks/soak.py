"""Soak: 2P2D under steady load; errors, wrong outputs, leaked slots, growth.

Starts ``fabric up`` (a child process: proxy + 4 tiny-model engines, 2P2D)
on free ports, sends ``--requests`` mixed completions (non-streamed and
streamed, prompt lengths 50..1500 tokens, a quarter of them sharing a long
prefix so the reuse tier is exercised) at ``--concurrency``, and samples the
resident memory (RSS) of the proxy process and of every engine's process
tree every ``--sample-s`` seconds. Afterwards it asks every engine's store
over its control channel how many slots are still reserved, held for a
reuse hit or quarantined (all must reach 0), reads fabric's failure
counters on every engine's ``/metrics``, and checks the proxy's counters.

Oracle: the prompts are fixed (seeded), and every ``--oracle-every``-th
request (half of them streamed) also asks for token ids and logprobs. Once
``fabric up`` is stopped, a colocated engine (same model, no connector)
serves those prompts again; each 2P2D output must equal its answer up to a
near-tie flip (the batches differ, so a token whose runner-up is within
``--near-tie-gap`` may flip; logprobs within ``--logprob-tol`` before it).

Pass criteria (printed, recorded, and the exit code): zero errors, zero
oracle mismatches, zero fabric failures it did not inject (it injects none:
``load_failures``, ``store_load_failures``, ``corrupt_chunks``,
``refused_transfers``, ``thread_errors``), zero slots left reserved, held or
quarantined, and proxy and engine RSS after warm-up (the first
``--warmup`` requests) within ``--rss-tolerance`` (10%) of their value at
the end of warm-up.

    python benchmarks/soak.py [--requests 2000] [--concurrency 32]
    python benchmarks/soak.py --requests 120 --concurrency 16 --warmup 30  # smoke

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
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from fabric.errors import FabricError, LaunchError
from fabric.launch.process import (
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
    wait_http_ok,
)
from fabric.transfer.lookup import StoreClient

ROOT = Path(__file__).resolve().parent
MODEL = "tiny"
# fabric counters that count a failure; this soak injects none, so all stay 0
FAILURE_COUNTERS = (
    "load_failures",
    "store_load_failures",
    "corrupt_chunks",
    "refused_transfers",
    "thread_errors",
)
# store stats that count a slot still taken once every request has ended
HELD_STATS = ("reserved", "holds", "quarantined")

Output = tuple[list[int], list[float]]  # generated token ids, their logprobs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument(
        "--oracle-every", type=int, default=20, help="replay every Nth request (0: no oracle)"
    )
    parser.add_argument("--logprob-tol", type=float, default=0.1)
    parser.add_argument("--near-tie-gap", type=float, default=0.2)
    parser.add_argument(
        "--held-timeout-s",
        type=float,
        default=60.0,
        help="how long slots may stay reserved, held or quarantined after the last answer",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def topology(workdir: Path) -> dict[str, Any]:
    engine = {"kv_cache_gib": 1}
    return {
        "model": MODEL,
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


def sampled(index: int, every: int) -> bool:
    """Whether request ``index`` is replayed by the oracle: one of every block
    of ``every``, its first even index in even blocks and its first odd one in
    odd blocks (odd requests are streamed: half the sample is)."""
    block = index // every if every > 0 else 0
    return every > 0 and index % every == block * (1 - every) % 2 % every


def completion_body(
    prompt: list[int], max_tokens: int, stream: bool, sample: bool
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if sample:
        payload |= {"logprobs": 1, "return_token_ids": True}
    return payload


def add_choice(output: Output, choice: dict[str, Any]) -> None:
    """Append a (whole or streamed) completion choice's token ids and logprobs."""
    output[0].extend(choice.get("token_ids") or [])
    output[1].extend((choice.get("logprobs") or {}).get("token_logprobs") or [])


async def one_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any]
) -> tuple[str | None, Output]:
    """(None when the answer is complete, else what went wrong; its tokens and
    logprobs, empty unless the payload asked for them)."""
    output: Output = ([], [])
    try:
        if not payload["stream"]:
            response = await client.post(url, json=payload)
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.text[:200]}", output
            choice = response.json()["choices"][0]
            add_choice(output, choice)
            return (None if choice["text"] is not None else "no text"), output
        got_done = False
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return error, output
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    got_done = True
                elif line.startswith("data: ") and '"error"' in line:
                    return f"stream error: {line[:200]}", output
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:]).get("choices", []):
                        add_choice(output, choice)
        return (None if got_done else "stream ended without [DONE]"), output
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}", output


async def drive(
    proxy_url: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    sample: Any,
) -> tuple[list[str], list[float], dict[int, Output]]:
    """Send every prompt at ``--concurrency``: (errors, latencies, the outputs
    of the sampled requests by index)."""
    url = proxy_url + "/v1/completions"
    errors: list[str] = []
    latencies: list[float] = []
    outputs: dict[int, Output] = {}
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
            keep = sampled(index, args.oracle_every)
            payload = completion_body(prompt, args.max_tokens, index % 2 == 1, keep)
            started = time.perf_counter()
            error, output = await one_request(client, url, payload)
            latencies.append(time.perf_counter() - started)
            if error is not None:
                errors.append(f"request {index}: {error}")
            elif keep:
                outputs[index] = output
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
    return errors, latencies, outputs


def wait_released(engines: list[dict[str, Any]], timeout_s: float) -> dict[str, dict[str, int]]:
    """Per engine store: slots reserved, held for a reuse hit, quarantined
    (a stat the store lacks is left out; reserved -1: it could not be asked).
    Polled until all are 0 (leases and quarantines end on their own), at
    most ``timeout_s``; the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        held: dict[str, dict[str, int]] = {}
        for engine in engines:
            try:
                with StoreClient(engine["kv_endpoint"], timeout_ms=5000) as store:
                    stats = store.stats()
            except (FabricError, OSError) as exc:
                print(f"  store of {engine['name']}: {exc}", flush=True)
                stats = {"reserved": -1}
            held[engine["name"]] = {k: int(stats[k]) for k in HELD_STATS if k in stats}
        if not any(v for counts in held.values() for v in counts.values()):
            return held
        if time.monotonic() > deadline:
            return held
        time.sleep(1.0)


def fabric_counters(engine_url: str) -> dict[str, float]:
    """Every ``vllm:fabric_<name>_total`` counter on the engine, by ``<name>``
    (none when ``/metrics`` cannot be read: every failure counter is missing)."""
    try:
        text = httpx.get(engine_url + "/metrics", timeout=30, trust_env=False).text
    except httpx.HTTPError as exc:
        print(f"  {engine_url}/metrics: {exc}", flush=True)
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^vllm:fabric_(\w+)_total(?:\{[^}]*\})? (\S+)$", line)
        if match:
            out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(2))
    return out


def mismatch(got: Output, want: Output, tol: float, gap: float) -> str | None:
    """What makes ``got`` differ from ``want`` beyond a near-tie flip, or None.

    Accepted: logprobs within ``tol`` up to the first different token, and
    at it both sides' tokens within ``gap`` of each other (the batches
    differ, so a near tie may flip; wrong KV would not give one).
    """
    (got_ids, got_lps), (want_ids, want_lps) = got, want
    if not got_ids or not len(got_ids) == len(want_ids) == len(got_lps) == len(want_lps):
        return f"lengths differ: {len(got_ids)} tokens vs {len(want_ids)}"
    pairs = enumerate(zip(got_ids, want_ids, strict=True))
    flip = next((i for i, (a, b) in pairs if a != b), len(got_ids))
    for i in range(flip + 1 if flip < len(got_ids) else flip):
        if abs(got_lps[i] - want_lps[i]) > (tol if i < flip else gap):
            what = "differs, no near tie" if i == flip else "same, logprob apart"
            return (
                f"token {i} {what}: {got_ids[i]} at {got_lps[i]:.3f}"
                f" vs {want_ids[i]} at {want_lps[i]:.3f}"
            )
    return None


def oracle(
    args: argparse.Namespace, workdir: Path, prompts: list[list[int]], outputs: dict[int, Output]
) -> dict[str, Any]:
    """Serve the sampled prompts on a colocated engine (no connector, the
    model ``fabric up`` built) and compare each 2P2D output with its answer."""
    port, oracle_dir = free_port(), workdir / "oracle"
    argv = vllm_serve_command(workdir / "models" / MODEL, port, served_model_name=MODEL)
    env = engine_env(oracle_dir, cpu_cores="0", kv_cache_gib=1)
    started = time.monotonic()
    log = oracle_dir / "colocated.log"
    with ManagedProcess(argv, log_path=log, env=env, name="colocated") as engine:
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/health", 900, engine)
        except LaunchError as exc:
            return {"compared": 0, "mismatches": len(outputs), "first_mismatches": [str(exc)]}
        start_s = time.monotonic() - started
        url = f"http://127.0.0.1:{port}/v1/completions"
        want = asyncio.run(replay(url, [prompts[i] for i in outputs], args.max_tokens))
    exact, problems = 0, []
    for (index, got), (error, answer) in zip(outputs.items(), want, strict=True):
        why = error or mismatch(got, answer, args.logprob_tol, args.near_tie_gap)
        if why is not None:
            problems.append(f"request {index} ({len(prompts[index])} tokens): {why}")
        elif got[0] == answer[0]:
            exact += 1
    return {
        "every": args.oracle_every,
        "compared": len(outputs),
        "exact": exact,
        "near_tie_flips": len(outputs) - exact - len(problems),
        "mismatches": len(problems),
        "first_mismatches": problems[:10],
        "colocated_start_s": round(start_s, 1),
    }


async def replay(url: str, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    """(error, output) of each prompt on ``url``, non-streamed, 4 at a time."""
    gate = asyncio.Semaphore(4)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[str | None, Output]:
        async with gate:
            return await one_request(client, url, completion_body(prompt, max_tokens, False, True))

    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


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
    prompts = make_prompts(args.requests)
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
        errors, latencies, outputs = asyncio.run(drive(proxy_url, prompts, args, sample))
        elapsed = time.monotonic() - started
        sample("end")
        held = wait_released(engines, args.held_timeout_s)
        counters = {e["name"]: fabric_counters(e["url"]) for e in engines}
        metrics = httpx.get(proxy_url + "/metrics", timeout=10).text
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
    checked = oracle(args, workdir, prompts, outputs) if outputs else None
    run_info = {"errors": errors, "latencies": latencies, "elapsed": elapsed}
    return summarize(args, samples, run_info, held, counters, metrics, checked)


def summarize(
    args: argparse.Namespace,
    samples: list[dict[str, Any]],
    run_info: dict[str, Any],
    held: dict[str, dict[str, int]],
    counters: dict[str, dict[str, float]],
    metrics: str,
    checked: dict[str, Any] | None,
) -> dict[str, Any]:
    errors, latencies, elapsed = run_info["errors"], run_info["latencies"], run_info["elapsed"]
    warm = next((s for s in samples if s["phase"] == "warmup"), samples[0])
    after = [s for s in samples if s["t"] >= warm["t"]]
    growth = {"proxy": max(s["proxy_rss"] for s in after) / warm["proxy_rss"] - 1}
    for name, base in warm["engines_rss"].items():
        growth[name] = max(s["engines_rss"][name] for s in after) / base - 1
    proxy_counters = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("fabric_proxy_") and line.split()[0].endswith("_total")
    }
    failures = {
        name: {k: values.get(k, 0.0) for k in FAILURE_COUNTERS} for name, values in counters.items()
    }
    missing = sorted({k for v in counters.values() for k in FAILURE_COUNTERS if k not in v})
    latencies.sort()
    want_sample = args.oracle_every > 0
    ok = (
        not errors
        and all(v == 0 for counts in held.values() for v in counts.values())
        and all(v == 0 for counts in failures.values() for v in counts.values())
        and not missing
        and (not want_sample or (checked is not None and checked["mismatches"] == 0))
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
        "oracle": checked,
        "reserved_slots_after": {name: counts.get("reserved", -1) for name, counts in held.items()},
        "held_slots_after": held,
        "fabric_failures": failures,
        "fabric_failure_counters_missing": missing,
        "fabric_counters": counters,
        "rss_growth_after_warmup": growth,
        "proxy_counters": proxy_counters,
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
    checked = result["oracle"] or {}
    print(f"errors {result['errors']}, held after {result['held_slots_after']}")
    print(f"fabric failures {result['fabric_failures']}; oracle {checked}")
    print(f"RSS growth after warm-up: {growth}")
    print(f"{result['rps']:.1f} req/s, p50 {result['latency_s']['p50']:.3f} s; wrote {out}")
    summary = {
        "passed": result["passed"],
        "errors": result["errors"],
        "oracle_compared": checked.get("compared", 0),
        "oracle_mismatches": checked.get("mismatches", 0),
        "fabric_failures": sum(v for c in result["fabric_failures"].values() for v in c.values()),
        "leaked_slots": sum(
            abs(v) for counts in result["held_slots_after"].values() for v in counts.values()
        ),
        "max_rss_growth": round(max(result["rss_growth_after_warmup"].values()), 4),
    }
    print(json.dumps(summary))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
