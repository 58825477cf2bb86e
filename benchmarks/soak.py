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
    python benchmarks/soak.py --chaos                                      # with kills

``--chaos`` adds a shared store to the topology and, while the requests run,
SIGKILLs a serving engine every ``--chaos-every-s`` (120 s, a fixed
cadence whether or not the last victim is back; the engines in a random
order, each once before any twice, from ``--chaos-seed``; the shared store
once, at the second kill): ``fabric up`` must restart it (see
``benchmarks/chaos.py``). A request may then fail, but only with an error
(an HTTP error status or an error event in its stream) within
``--request-timeout-s``; one without an answer or an error is *unanswered*.
Load failures are expected (the kills cause them); corrupt or refused KV is
not. Every process alive at warm-up is judged for RSS from its value then
(the shared store's included), a restarted one from its own value 60 s
after it served again, and
each killed process must answer again within its own start time under the
same load plus ``--restart-slack-s`` (10 s): the start of a bare copy of it
(vLLM without fabric; the store on a port of its own) begun at the kill and
timed beside the restart. Each kill's record also keeps the restart's own
start (``restart_boot_s``) and the process's first start in the topology
(``first_start_s``), started unloaded.

Every run also checks that fabric's per-request tables are empty afterwards
(each worker's, over its control channel; each scheduler's and the proxy's,
from ``/metrics``) and that the p99 of the time fabric held vLLM's scheduler
per step (``vllm:fabric_scheduler_hold_seconds``, all engines, every
incarnation) is at most ``--max-hold-p99-ms`` (20 ms). The last stdout line
is a JSON summary, also saved in the result file under ``summary``::

    {"unanswered", "wrong_outputs", "leaked_slots", "leaked_entries",
     "rss_growth_max", "sched_hold_p99_ms", "restart_to_serving_s_max"}

Not part of CI's default run (it takes ~10-30 minutes on 2 cores). Results go
to ``benchmarks/results/soak-<date>.json`` (``soak-chaos-<date>.json``).
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

from fabric.bench.serve import sse_lines
from fabric.errors import FabricError, LaunchError
from fabric.launch.process import (
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
    wait_http_ok,
)
from fabric.transfer.store_client import StoreClient

ROOT = Path(__file__).resolve().parent
if str(ROOT.parent) not in sys.path:  # NOTE: run as a script: the repository root
    sys.path.insert(0, str(ROOT.parent))
from benchmarks.chaos import (  # noqa: E402
    WAIT_METRIC,
    Chaos,
    Kill,
    Scraper,
    histogram_quantile,
    parse_tables,
    read_state,
    rss_growth,
    store_entry,
)

MODEL = "tiny"
# fabric counters that count a failure; this soak injects none, so all stay 0
FAILURE_COUNTERS = (
    "load_failures",
    "store_load_failures",
    "corrupt_chunks",
    "refused_transfers",
    "thread_errors",
)
# under --chaos kills cause load failures; these never have a cause but a bug
CHAOS_FAILURE_COUNTERS = ("corrupt_chunks", "refused_transfers")
# worker tables bounded by peers, not requests (one entry per peer is fine),
# and a receiver's abandoned transfers (bounded in count and to 40 s: the
# Reserves it refuses, not state a request holds)
PEER_TABLES = ("_peers", "_links", "_abandoned")
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
    parser.add_argument(
        "--chaos",
        action="store_true",
        help="SIGKILL a random engine every --chaos-every-s (once the shared store); "
        "fabric up must restart it",
    )
    parser.add_argument("--chaos-every-s", type=float, default=120.0)
    parser.add_argument(
        "--chaos-seed",
        type=int,
        default=None,
        help="seed of the victims' order (default: a fresh one, recorded)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=300.0,
        help="a request without an answer (or an error) by then is unanswered",
    )
    parser.add_argument(
        "--kill-window-s",
        type=float,
        default=30.0,
        help="--chaos: errors count as caused by a kill until this long after its "
        "victim serves again",
    )
    parser.add_argument(
        "--max-hold-p99-ms",
        type=float,
        default=20.0,
        help="goal: p99 of the time fabric held vLLM's scheduler per step",
    )
    parser.add_argument(
        "--restart-slack-s",
        type=float,
        default=10.0,
        help="goal: a killed process serves again within its own start under the same "
        "load (a bare copy's, begun at the kill) plus this",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="the engines' --dtype (the oracle's too); float32 prefills several times "
        "faster on a CPU without bf16 instructions (AVX2 only)",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def topology(workdir: Path, *, chaos: bool = False, dtype: str = "bfloat16") -> dict[str, Any]:
    engine: dict[str, Any] = {"kv_cache_gib": 1, "args": ["--dtype", dtype]}
    shared = {"store": {"mem_gib": 1}} if chaos else {}
    return shared | {
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


class Unanswered(Exception):
    """No answer and no error: the connection broke, the deadline passed, or a
    stream stopped without ``[DONE]`` or an error event."""


async def one_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any]
) -> tuple[str | None, Output]:
    """(None when the answer is complete, else the error the server gave; its
    tokens and logprobs, empty unless the payload asked for them).

    Raises :class:`Unanswered` when there was neither an answer nor an error.
    """
    output: Output = ([], [])
    try:
        if not payload["stream"]:
            response = await client.post(url, json=payload)
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.text[:200]}", output
            try:
                choice = response.json()["choices"][0]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                return f"HTTP 200 without a completion: {exc!r}: {response.text[:200]}", output
            add_choice(output, choice)
            return (None if choice["text"] is not None else "no text"), output
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return error, output
            async for line in sse_lines(response):
                if line == "data: [DONE]":
                    return None, output
                elif line.startswith("data: ") and '"error"' in line:
                    return f"stream error: {line[:200]}", output
                elif line.startswith("data: "):
                    try:
                        choices = json.loads(line[6:]).get("choices", [])
                    except (ValueError, AttributeError) as exc:
                        return f"stream event is not JSON: {exc!r}: {line[:200]}", output
                    for choice in choices:
                        add_choice(output, choice)
        raise Unanswered("stream ended without [DONE] or an error event")
    except httpx.HTTPError as exc:
        raise Unanswered(f"{type(exc).__name__}: {exc}") from exc


async def drive(
    proxy_url: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    sample: Any,
    scrape: Any,
    chaos: Chaos | None = None,
) -> tuple[list[str], list[float], dict[int, Output], list[str], list[float]]:
    """Send every prompt at ``--concurrency``: (errors, latencies, the outputs
    of the sampled requests by index, the unanswered ones among the errors)."""
    url = proxy_url + "/v1/completions"
    errors: list[str] = []
    error_times: list[float] = []  # NOTE: monotonic, when each error came
    unanswered: list[str] = []
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
            try:
                error, output = await one_request(client, url, payload)
            except Unanswered as exc:
                unanswered.append(f"request {index}: {exc}")
                error, output = f"unanswered: {exc}", ([], [])
            latencies.append(time.perf_counter() - started)
            if error is not None:
                errors.append(f"request {index}: {error}")
                error_times.append(time.monotonic())
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
            await scrape()

    limits = httpx.Limits(max_connections=args.concurrency)
    timeout = args.request_timeout_s
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        tasks = [asyncio.create_task(sampler())]
        if chaos is not None:
            tasks.append(asyncio.create_task(chaos.run(stop)))
        try:
            await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        finally:
            stop.set()
            tasks[0].cancel()
            if chaos is not None:  # NOTE: the victim of a late kill must come back too
                await tasks[1]
    return errors, latencies, outputs, unanswered, error_times


def wait_released(
    engines: list[dict[str, Any]], timeout_s: float
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Per engine store: slots reserved, held for a reuse hit, quarantined
    (a stat the store lacks is left out; reserved -1: it could not be asked),
    and the worker's per-request table sizes. Polled until all are 0 (leases
    and quarantines end on their own), at most ``timeout_s``; the last
    reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        held: dict[str, dict[str, int]] = {}
        tables: dict[str, dict[str, int]] = {}
        for engine in engines:
            try:
                with StoreClient(engine["kv_endpoint"], timeout_ms=5000) as store:
                    stats = store.stats()
            except (FabricError, OSError) as exc:
                print(f"  store of {engine['name']}: {exc}", flush=True)
                stats = {"reserved": -1}
            held[engine["name"]] = {k: int(stats[k]) for k in HELD_STATS if k in stats}
            tables[engine["name"]] = {
                k.removeprefix("tables."): int(v)
                for k, v in stats.items()
                if k.startswith("tables.") and not k.endswith(PEER_TABLES)
            }
        leaked = [v for by in (held, tables) for counts in by.values() for v in counts.values()]
        if not any(leaked) or time.monotonic() > deadline:
            return held, tables
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
    argv = vllm_serve_command(
        workdir / "models" / MODEL,
        port,
        served_model_name=MODEL,
        extra_args=["--dtype", args.dtype],
    )
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
            try:
                return await one_request(
                    client, url, completion_body(prompt, max_tokens, False, True)
                )
            except Unanswered as exc:
                return f"unanswered: {exc}", ([], [])

    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    config = workdir / "soak.yaml"
    config.write_text(yaml.safe_dump(topology(workdir, chaos=args.chaos, dtype=args.dtype)))
    log = open(workdir / "up.log", "w")  # noqa: SIM115 - closed in finally
    launched = time.monotonic()
    up = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", "up", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    state_path = workdir / "run" / "up.json"
    samples: list[dict[str, Any]] = []
    prompts = make_prompts(args.requests)
    scraper = Scraper()
    bare_dir = workdir / "bare"
    bare_dir.mkdir(exist_ok=True)
    chaos = (
        Chaos(state_path, args.chaos_every_s, seed=args.chaos_seed, scratch=bare_dir)
        if args.chaos
        else None
    )
    try:
        deadline = time.monotonic() + 1200
        while not state_path.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fabric up did not come up; see {workdir / 'up.log'}")
            time.sleep(1)
        start_s = time.monotonic() - launched
        state = read_state(state_path)
        proxy_url = state["proxy_url"]
        print(
            f"2P2D up at {proxy_url} after {start_s:.0f} s; {args.requests} requests at "
            f"c={args.concurrency}{', chaos' if chaos else ''}",
            flush=True,
        )

        def engines_now() -> list[dict[str, Any]]:
            try:
                return list(read_state(state_path)["engines"])
            except (OSError, ValueError, KeyError):
                return list(state["engines"])

        def sample(phase: str) -> None:
            rss = {f"proxy/{up.pid}": own_rss(up.pid)}
            try:
                store = store_entry(read_state(state_path))
            except (OSError, ValueError):
                store = None
            for e in [*engines_now(), *([{"name": "store", **store}] if store else [])]:
                # NOTE: a restarted engine is judged once it serves (its start-up grows)
                if e.get("pid") and e.get("state", "up") == "up":
                    rss[f"{e['name']}/{e['pid']}"] = tree_rss(int(e["pid"]))
            samples.append({"t": time.time(), "phase": phase, "rss": rss})

        async def scrape() -> None:
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                await scraper.scrape(client, engines_now())

        sample("start")
        started = time.monotonic()
        errors, latencies, outputs, unanswered, error_times = asyncio.run(
            drive(proxy_url, prompts, args, sample, scrape, chaos)
        )
        elapsed = time.monotonic() - started
        sample("end")
        engines = engines_now()
        held, tables = wait_released(engines, args.held_timeout_s)
        flush_steps(engines)
        asyncio.run(scrape())
        counters = {e["name"]: fabric_counters(e["url"]) for e in engines}
        for e in engines:
            page = scraper.pages.get((e["name"], int(e["pid"] or 0)), "")
            scheduler = {k: v for k, v in parse_tables(page).items() if k.startswith("scheduler")}
            tables[e["name"]] = tables.get(e["name"], {}) | {
                k: int(v) for k, v in scheduler.items()
            }
        metrics, tables["proxy"] = proxy_idle(proxy_url, args.held_timeout_s)
        # NOTE: each engine's own first start (fabric up records it), else the topology's
        final = read_state(state_path)
        store = final.get("store") or {}
        restart_goal = {
            e["name"]: float(e.get("first_start_s") or start_s)
            for e in [*engines, {"name": "store", **store}]
        }
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
    checked = oracle(args, workdir, prompts, outputs) if outputs else None
    run_info = {
        "errors": errors,
        "unanswered": unanswered,
        "latencies": latencies,
        "elapsed": elapsed,
        "start_s": start_s,
        "kills": [k.to_dict() for k in chaos.kills] if chaos else [],
        "chaos_seed": chaos.seed if chaos else None,
        "errors_outside_kills": outside_kills(
            error_times, chaos.kills if chaos else [], args.kill_window_s
        ),
        "restart_goal_s": restart_goal,
        "hold_buckets": scraper.hold_histogram(),
        "wait_buckets": scraper.hold_histogram(WAIT_METRIC),
        "tables": tables,
    }
    return summarize(args, samples, run_info, held, counters, metrics, checked)


def flush_steps(engines: list[dict[str, Any]]) -> None:
    """One tiny request straight to each engine, so its scheduler runs a step
    now that the leases of lookups it gave up on have ended (its table gauges
    are reported per step, after the step's finished requests are freed)."""
    payload = completion_body([7, 8, 9], 1, False, False)
    for engine in engines:
        try:
            httpx.post(engine["url"] + "/v1/completions", json=payload, timeout=60, trust_env=False)
        except httpx.HTTPError as exc:
            print(f"  flush request to {engine['name']}: {exc}", flush=True)


def outside_kills(error_times: list[float], kills: list[Kill], window_s: float) -> int:
    """Errors that no kill explains: not between a kill and ``window_s``
    after its victim served again (requests then in flight may fail, with
    an error; the next ones are routed around the victim)."""
    spans = [(k.at, (k.serving_at or float("inf")) + window_s) for k in kills]
    return sum(1 for t in error_times if not any(a <= t <= b for a, b in spans))


def proxy_idle(proxy_url: str, timeout_s: float) -> tuple[str, dict[str, int]]:
    """The proxy's ``/metrics`` page and table sizes, polled until every
    table is empty (a canary or health probe may be in flight), at most
    ``timeout_s``; the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = httpx.get(proxy_url + "/metrics", timeout=10, trust_env=False).text
        tables = proxy_tables(metrics)
        if not any(tables.values()) or time.monotonic() > deadline:
            return metrics, tables
        time.sleep(1.0)


def proxy_tables(metrics: str) -> dict[str, int]:
    """The proxy's ``fabric_proxy_table_entries`` gauges by table."""
    out: dict[str, int] = {}
    for line in metrics.splitlines():
        match = re.match(r'^fabric_proxy_table_entries\{.*table="([^"]+)".*\} (\S+)$', line)
        if match:
            out[match.group(1)] = out.get(match.group(1), 0) + int(float(match.group(2)))
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


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
    unanswered = run_info["unanswered"]
    warm = next((s for s in samples if s["phase"] == "warmup"), samples[0])
    after = [s for s in samples if s["t"] >= warm["t"]]
    # NOTE: every process alive at warm-up is judged from its value then; a
    # restarted one (a new process) from its own value 60 s after it served
    growth, short_lived = rss_growth(
        after, settle_s=60.0, min_life_s=3 * args.sample_s, settled=set(warm["rss"])
    )
    proxy_counters = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("fabric_proxy_") and line.split()[0].endswith("_total")
    }
    # NOTE: kills cause load failures (injected); wrong or corrupt KV never
    watched = CHAOS_FAILURE_COUNTERS if args.chaos else FAILURE_COUNTERS
    failures = {name: {k: values.get(k, 0.0) for k in watched} for name, values in counters.items()}
    missing = sorted({k for v in counters.values() for k in watched if k not in v})
    latencies.sort()
    tables = run_info["tables"]
    kills = run_info["kills"]
    backs = [k["restart_to_serving_s"] for k in kills]
    first = run_info["restart_goal_s"]
    for k in kills:
        # NOTE: the yardstick is the bare copy's start under the same load;
        # without one (it failed), the first start in the topology
        k["first_start_s"] = first.get(k["victim"], run_info["start_s"])
        k["yardstick_s"] = (
            k["bare_start_s"] if k["bare_start_s"] is not None else k["first_start_s"]
        )
    late = [
        k
        for k in kills
        if k["restart_to_serving_s"] is None
        or k["restart_to_serving_s"] > k["yardstick_s"] + args.restart_slack_s
    ]
    hold_p99 = histogram_quantile(run_info["hold_buckets"], 0.99)
    summary = {
        "unanswered": len(unanswered),
        "wrong_outputs": None if checked is None else checked["mismatches"],
        "leaked_slots": sum(abs(v) for counts in held.values() for v in counts.values()),
        "leaked_entries": sum(v for counts in tables.values() for v in counts.values()),
        "rss_growth_max": round(max(growth.values(), default=0.0), 4),
        "sched_hold_p99_ms": _ms(hold_p99),
        "restart_to_serving_s_max": (
            max(backs, default=None) if all(b is not None for b in backs) else None
        ),
    }
    want_sample = args.oracle_every > 0
    ok = (
        (not errors or (args.chaos and run_info["errors_outside_kills"] == 0))
        and not unanswered
        and summary["leaked_slots"] == 0
        and summary["leaked_entries"] == 0
        and all(v == 0 for counts in failures.values() for v in counts.values())
        and not missing
        and (not want_sample or (checked is not None and checked["mismatches"] == 0))
        and all(g <= args.rss_tolerance for g in growth.values())
        and hold_p99 is not None
        and hold_p99 * 1000 <= args.max_hold_p99_ms
        and not late
    )
    return {
        "benchmark": "soak-chaos" if args.chaos else "soak",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count()},
        "passed": ok,
        "summary": summary,
        "requests": args.requests,
        "errors": len(errors),
        "errors_outside_kills": run_info["errors_outside_kills"],
        "first_errors": errors[:20],
        "first_unanswered": unanswered[:20],
        "elapsed_s": elapsed,
        "rps": args.requests / elapsed,
        "latency_s": {
            "p50": latencies[len(latencies) // 2],
            "p99": latencies[int(len(latencies) * 0.99) - 1],
        },
        "start_s": run_info["start_s"],
        "kills": kills,
        "chaos_seed": run_info["chaos_seed"],
        "late_restarts": late,
        "scheduler_hold_buckets": {str(k): v for k, v in sorted(run_info["hold_buckets"].items())},
        # NOTE: the hold's part spent waiting for lookup answers; the rest is
        # fabric's bookkeeping and the box descheduling vLLM's thread
        "scheduler_wait_buckets": {str(k): v for k, v in sorted(run_info["wait_buckets"].items())},
        "sched_wait_p99_ms": _ms(histogram_quantile(run_info["wait_buckets"], 0.99)),
        "oracle": checked,
        "held_slots_after": held,
        "tables_after": tables,
        "fabric_failures": failures,
        "fabric_failure_counters_missing": missing,
        "fabric_counters": counters,
        "rss_growth_after_warmup": growth,
        "rss_not_judged": short_lived,
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
    name = "soak-chaos" if args.chaos else "soak"
    out = args.out or ROOT / "results" / f"{name}-{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    growth = {k: f"{v:+.1%}" for k, v in result["rss_growth_after_warmup"].items()}
    checked = result["oracle"] or {}
    summary = result["summary"]
    print(f"errors {result['errors']} (unanswered {summary['unanswered']})")
    print(f"held after {result['held_slots_after']}; tables after {result['tables_after']}")
    print(f"fabric failures {result['fabric_failures']}; oracle {checked}")
    print(f"RSS growth after warm-up: {growth}; kills {result['kills']}")
    print(f"{result['rps']:.1f} req/s, p50 {result['latency_s']['p50']:.3f} s; wrote {out}")
    print(json.dumps(summary))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
