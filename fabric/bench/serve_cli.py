"""Command line of ``fabric bench serve`` (:mod:`fabric.bench.serve`).

    fabric bench serve --url http://127.0.0.1:8000 --model tiny \\
        --num-requests 200 --input-tokens 128:512 --shared-prefix 0.5 \\
        --rate 8 --max-tokens 64 --json results/serve.json

``--input-tokens`` is N or MIN:MAX. Without ``--tokenizer-url`` a prompt's
length in tokens is its length in words (see
:mod:`fabric.bench.serve_workload`); with it, prompts are fitted with the
server's ``/tokenize``. Neither ``--rate`` nor ``--concurrency``: one request
at a time. Ends with one JSON line of the main numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.bench import parse_config
from fabric.bench.serve import ENDPOINTS, ServeConfig, run_serve_bench
from fabric.bench.serve_workload import (
    HttpTokenCounter,
    LengthSpec,
    WorkloadConfig,
    build_prompts,
)

if TYPE_CHECKING:
    from rich.table import Table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fabric bench serve",
        description="TTFT, ITL and latency of an OpenAI-compatible endpoint under load",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default="tiny")
    p.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0])
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument(
        "--input-tokens",
        default="256",
        help="prompt tokens: N or MIN:MAX (counted as words unless --tokenizer-url)",
    )
    p.add_argument("--shared-prefix", type=float, default=0.0, help="fraction of each prompt")
    p.add_argument("--rate", type=float, help="requests/s, Poisson arrivals")
    p.add_argument("--concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ignore-eos", action="store_true", help="vLLM: always max_tokens out")
    p.add_argument(
        "--tokenizer-url", help="server with vLLM's POST /tokenize to fit prompts to exact tokens"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, dest="json_path", help="write the full report here")
    return p


def config_from_args(ns: argparse.Namespace) -> ServeConfig:
    workload = WorkloadConfig(
        num_requests=ns.num_requests,
        input_tokens=LengthSpec.parse(ns.input_tokens),
        shared_prefix=ns.shared_prefix,
        rate=ns.rate,
        seed=ns.seed,
    )
    return ServeConfig(
        url=ns.url.rstrip("/"),
        model=ns.model,
        endpoint=ns.endpoint,
        max_tokens=ns.max_tokens,
        stream=ns.stream,
        concurrency=ns.concurrency,
        ignore_eos=ns.ignore_eos,
        timeout_s=ns.timeout,
        workload=workload,
    )


def main(argv: list[str] | None = None) -> int:
    """Run, print a table (and the JSON path), end with one JSON line; 1 if any request failed."""
    from rich.console import Console

    ns, config = parse_config(build_parser(), argv, config_from_args)
    counter = HttpTokenCounter(ns.tokenizer_url, config.model) if ns.tokenizer_url else None
    try:
        prompts = build_prompts(config.workload, counter)
    finally:
        if counter is not None:
            counter.close()
    report = run_serve_bench(config, prompts)
    report["prompt_tokens_counted"] = counter is not None
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(summary_table(report))
    for message in report["errors"]["first"]:
        console.print(f"[red]error[/red] {message}")
    if ns.json_path is not None:
        ns.json_path.parent.mkdir(parents=True, exist_ok=True)
        ns.json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"saved {ns.json_path}")
    print(json.dumps(headline(report)))
    return 1 if report["errors"]["count"] else 0


def headline(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "requests_per_s": report["requests_per_s"],
        "output_tokens_per_s": report["output_tokens_per_s"],
        "ttft_p50_ms": report["ttft_ms"]["p50"],
        "itl_p50_ms": report["itl_ms"]["p50"],
        "e2e_p50_ms": report["e2e_ms"]["p50"],
        "errors": report["errors"]["count"],
    }


def summary_table(report: dict[str, Any]) -> Table:
    from rich.table import Table

    cfg = report["config"]
    wl = cfg["workload"]
    load = f"rate {wl['rate']}/s" if wl["rate"] else "no rate"
    if cfg["concurrency"]:
        load += f", concurrency {cfg['concurrency']}"
    title = (
        f"{cfg['url']}{cfg['endpoint']} {cfg['model']}: {report['completed']}/"
        f"{report['requests']} ok, {load}, prompts {wl['input_tokens']} tokens "
        f"({wl['shared_prefix']:.0%} shared), max_tokens {cfg['max_tokens']}"
    )
    table = Table(title=title)
    table.add_column("metric")
    for name in ("p50", "p90", "p99", "mean", "n"):
        table.add_column(name, justify="right")
    for name, key in (("TTFT ms", "ttft_ms"), ("ITL ms", "itl_ms"), ("E2E ms", "e2e_ms")):
        stats = report[key]
        table.add_row(
            name,
            *(
                "-" if stats[c] is None else str(stats[c])
                for c in ("p50", "p90", "p99", "mean", "n")
            ),
        )
    table.caption = (
        f"{report['requests_per_s']} req/s, {report['output_tokens_per_s']} output tokens/s "
        f"over {report['duration_s']} s; errors {report['errors']['count']}"
    )
    return table
