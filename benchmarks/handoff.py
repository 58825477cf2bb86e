"""Early vs sequential handoff through fabric's proxy, on the same engines, interleaved.

    python benchmarks/handoff.py [--lengths 1024,2048,4096] [--requests 7] [--kv-heavy]

One prefiller (core 0) and one decoder (core 1) with the FabricConnector,
one colocated engine without a connector (core 0), all real vLLM CPU
engines with the same flags, and two fabric proxies in this process over
the same P and D: ``handoff: early`` (D gets its request at dispatch) and
``handoff: sequential`` (D after P answered). Every round sends, for each
prompt length, one request to each of the three targets in a shuffled
order, each with a fresh random prompt (no prefix-cache hit anywhere),
greedy, ``max_tokens`` 8, streamed, one request at a time; so a busy spell
on the shared machine lands on all three alike.

Reported per length and target: TTFT (request sent -> first token) median
and p90; per length the ratios of medians early/sequential and
early/colocated, each with a bootstrap 90% interval (resampling each
target's TTFTs, 2,000 draws). Outputs are compared with the colocated
engine's (token ids). Results go to ``benchmarks/results/handoff-<date>.json``;
the last line is ``{"ttft_early_over_sequential_max": .., "ttft_early_over_sequential_hi_max": ..,
"ttft_early_over_colocated_max": .., "ttft_early_over_colocated_hi_max": ..}``
(each the worst length).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fabric.config import parse_topology  # noqa: E402
from fabric.launch.process import (  # noqa: E402
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
    wait_http_ok,
)

TARGETS = ("early", "sequential", "colocated")
ENGINE_FLAGS = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "16"]
MAX_TOKENS = 8


def kv_config(role: str, kv_port: int | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"chunk_tokens": 256, "store_mib": 512}
    if kv_port is not None:
        extra["kv_port"] = kv_port
    return {
        "kv_connector": "FabricConnector",
        "kv_connector_module_path": "fabric.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@contextmanager
def engine(
    name: str, model: Path, work: Path, cores: str, kv: dict[str, Any] | None
) -> Iterator[str]:
    port = free_port()
    argv = vllm_serve_command(
        model,
        port,
        kv_transfer_config=kv,
        extra_args=ENGINE_FLAGS,
        max_model_len=4608,  # NOTE: a 4,096-token prompt and its output tokens
        served_model_name="tiny",
    )
    env = engine_env(work / name, cpu_cores=cores, kv_cache_gib=2)
    process = ManagedProcess(argv, log_path=work / f"{name}.log", env=env, name=name)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/health", 600, process)
        yield url
    finally:
        process.stop()


@contextmanager
def proxy(p_url: str, d_url: str, kv_port: int, handoff: str) -> Iterator[str]:
    """A fabric proxy app served by uvicorn in a thread of this process."""
    import uvicorn

    from fabric.router.app import create_app

    settings = {"port": None, "handoff": handoff, "health_interval_s": 0}
    topology = parse_topology(
        {
            "prefill": [{"name": "p0", "url": p_url}],
            "decode": [{"name": "d0", "url": d_url, "kv_port": kv_port}],
            "proxy": settings,
        }
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(topology), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


async def ttft(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds to the first streamed token, and the output token ids."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    started = time.monotonic()
    first: float | None = None
    ids: list[int] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.monotonic() - started
                ids += got
    if first is None:
        raise RuntimeError(f"{url}: no token")
    return first, ids


def bootstrap_ratio(
    a: list[float], b: list[float], draws: int = 2000, seed: int = 7
) -> list[float]:
    """90% interval of median(a) / median(b), resampling each side."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(draws)
    )
    return [ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]]


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


async def measure(urls: dict[str, str], lengths: list[int], requests: int) -> dict[str, Any]:
    rng = random.Random(11)
    samples: dict[int, dict[str, list[float]]] = {n: {t: [] for t in TARGETS} for n in lengths}
    mismatches: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        for n in lengths:  # NOTE: one warm-up per target and length (not recorded)
            for target in TARGETS:
                await ttft(client, urls[target], [rng.randrange(5, 500) for _ in range(n)])
        for round_ in range(requests):
            for n in lengths:
                order = list(TARGETS)
                rng.shuffle(order)
                prompts = {t: [rng.randrange(5, 500) for _ in range(n)] for t in TARGETS}
                outputs = {}
                for target in order:
                    seconds, outputs[target] = await ttft(client, urls[target], prompts[target])
                    samples[n][target].append(seconds)
                # NOTE: each PD output against the colocated engine's for the same prompt
                for target in ("early", "sequential"):
                    _, want = await ttft(client, urls["colocated"], prompts[target])
                    if outputs[target] != want:
                        mismatches.append({"round": round_, "tokens": n, "target": target})
            print(f"  round {round_ + 1}/{requests} done", flush=True)
    return {"samples": samples, "mismatches": mismatches}


def summarize(samples: dict[int, dict[str, list[float]]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for n, by_target in samples.items():
        row: dict[str, Any] = {
            t: {"median_s": statistics.median(v), "p90_s": p90(v), "n": len(v)}
            for t, v in by_target.items()
        }
        for other in ("sequential", "colocated"):
            early, base = by_target["early"], by_target[other]
            row[f"early_over_{other}"] = {
                "ratio": statistics.median(early) / statistics.median(base),
                "interval_90": bootstrap_ratio(early, base),
            }
        table[str(n)] = row
    return table


def headline(table: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for other in ("sequential", "colocated"):
        key = f"early_over_{other}"
        out[f"ttft_{key}_max"] = round(max(row[key]["ratio"] for row in table.values()), 3)
        out[f"ttft_{key}_hi_max"] = round(
            max(row[key]["interval_90"][1] for row in table.values()), 3
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--requests", type=int, default=7, help="rounds (requests per point)")
    parser.add_argument("--kv-heavy", action="store_true", help="the KV-heavy tiny model")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    from fabric.testing.models.tiny import make_tiny_model

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fabric-handoff-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model = make_tiny_model(work / "model", kv_heavy=args.kv_heavy)
        kv_port = free_port()
        p_url = stack.enter_context(engine("prefill", model, work, "0", kv_config("kv_producer")))
        d_url = stack.enter_context(
            engine("decode", model, work, "1", kv_config("kv_consumer", kv_port))
        )
        c_url = stack.enter_context(engine("colocated", model, work, "0", None))
        urls = {
            "early": stack.enter_context(proxy(p_url, d_url, kv_port, "early")),
            "sequential": stack.enter_context(proxy(p_url, d_url, kv_port, "sequential")),
            "colocated": c_url,
        }
        print(f"engines up after {time.monotonic() - started:.0f} s; measuring", flush=True)
        measured = asyncio.run(measure(urls, lengths, args.requests))
    table = summarize(measured["samples"])
    summary = headline(table)
    for n, row in table.items():
        cells = "  ".join(f"{t} {row[t]['median_s'] * 1000:.0f} ms" for t in TARGETS)
        ratio = row["early_over_sequential"]
        lo, hi = ratio["interval_90"]
        print(f"{n:>5} tokens: {cells}  early/sequential {ratio['ratio']:.3f} [{lo:.3f}, {hi:.3f}]")
    result = {
        "benchmark": "handoff",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {"lengths": lengths, "requests": args.requests, "kv_heavy": args.kv_heavy},
        "elapsed_s": round(time.monotonic() - started, 1),
        "table": table,
        "samples": {str(n): v for n, v in measured["samples"].items()},
        "mismatches": measured["mismatches"],
        "summary": summary,
    }
    day = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"handoff-{day}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}; {len(measured['mismatches'])} outputs differ from colocated")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
