"""Proxy benchmark: what the PD proxy adds to a request, and how many it serves.

    python benchmarks/proxy.py [--quick]

Prints a table and the added p50 at one client against both baselines
(direct: one call to the fake decoder; direct_pd: the client calling P then
D itself), writes benchmarks/results/proxy-<date>.json (with
"p50_added_vs_pd_ms_c1" too) and ends with one JSON line: {"p50_added_ms_c1":
.., "p99_added_ms_c32": .., "proxy_rps": .., "direct_rps": ..}, the first
against direct.

::

    load generator (this process, one aiohttp session)
       |-- direct --------------------------------------------> fake decoder
       |-- direct_pd: the prefill, then the decode, from here -> P, then D
       '-- proxy -----> fabric proxy CONFIG --> fake prefiller
                        (a subprocess)      '-> fake decoder

The fake engines (``python -m fabric.testing.fake_engine``) answer at once,
so a proxied request's extra latency is the proxy's own work plus the fake
prefill round trip that every PD request makes ("added vs P+D" subtracts
that round trip: the proxy's own share). Each concurrency level sends the
same non-streaming ~1 KB completion to each target in turn, bounded by a
request count and a time. The proxy's CPU time per request is read from
``/proc``. Everything, the load
generator included, shares the machine's cores: the numbers are this box's,
not the proxy's ceiling.

Headline: ``p50_added_ms_c1`` is the median latency at one client through
the proxy minus ``direct`` (one call to the fake decoder), so it includes
the prefill round trip any PD proxy makes; ``p50_added_vs_pd_ms_c1``
(printed, and recorded next to the headline) subtracts ``direct_pd``
instead: the proxy's own share.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from fabric.launch.process import free_port

HOST = "127.0.0.1"
PROMPT = " ".join(f"word{i}" for i in range(128))  # ~1 KB
BODY = {"model": "fake", "prompt": PROMPT, "max_tokens": 16}


@dataclass(frozen=True)
class Level:
    """One load level: ``concurrency`` clients, at most ``requests`` or ``seconds``."""

    concurrency: int
    requests: int
    seconds: float


FULL = (Level(1, 3000, 4.0), Level(32, 30000, 6.0), Level(128, 30000, 6.0))
QUICK = (Level(1, 20, 2.0), Level(32, 64, 2.0), Level(128, 128, 2.0))


@dataclass
class Run:
    """What one target did at one level."""

    target: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    proxy_cpu_ms_per_request: float | None = None


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process logging to ``log``, stopped by pid on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 30) -> None:
    """Poll ``url`` until it answers 200; fail with the log's tail if the child dies."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout_s} s: {log.read_text()[-2000:]}")


def fake_engine(role: str, port: int, kv_port: int, tmp: Path) -> list[str]:
    """The command line of a fake engine."""
    return [
        sys.executable, "-m", "fabric.testing.fake_engine", "--host", HOST, "--port", str(port),
        "--role", role, "--name", role, "--kv-port", str(kv_port),
    ]  # fmt: skip


def write_topology(tmp: Path, prefill_url: str, decode_url: str, proxy_port: int) -> Path:
    """A topology YAML of the two running fake engines."""
    config = {
        "workdir": str(tmp),
        "prefill": [{"url": prefill_url}],
        "decode": [{"url": decode_url, "kv_port": free_port()}],
        "proxy": {"host": HOST, "port": proxy_port},
    }
    path = tmp / "proxy-bench.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (Linux ``/proc``; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Steps = list[tuple[str, bytes]]


async def load(session: Any, steps: Steps, level: Level) -> tuple[list[float], int, float]:
    """Each request POSTs ``steps`` in turn, from ``level.concurrency`` clients.

    Returns the latencies (s), the number of failed requests and the wall time.
    """
    headers = {"content-type": "application/json"}
    latencies: list[float] = []
    errors = 0
    sent = 0
    started = time.perf_counter()
    deadline = started + level.seconds

    async def client() -> None:
        nonlocal sent, errors
        while sent < level.requests and time.perf_counter() < deadline:
            sent += 1
            t0 = time.perf_counter()
            ok = True
            for url, payload in steps:
                async with session.post(url, data=payload, headers=headers) as response:
                    await response.read()
                    ok = ok and response.status == 200
            latencies.append(time.perf_counter() - t0)
            errors += not ok

    await asyncio.gather(*(client() for _ in range(level.concurrency)))
    return latencies, errors, time.perf_counter() - started


def targets(prefill_url: str, decode_url: str, proxy_url: str) -> dict[str, Steps]:
    """direct (D alone), direct_pd (P then D, as the proxy calls them), proxy."""
    path = "/v1/completions"
    body = json.dumps(BODY).encode()
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "bench"}
    prefill = json.dumps({**BODY, "max_tokens": 1, "kv_transfer_params": params}).encode()
    return {
        "direct": [(decode_url + path, body)],
        "direct_pd": [(prefill_url + path, prefill), (decode_url + path, body)],
        "proxy": [(proxy_url + path, body)],
    }


async def measure(targets: dict[str, Steps], levels: Sequence[Level], proxy_pid: int) -> list[Run]:
    """Every level against every target, one shared aiohttp session."""
    import aiohttp

    # NOTE: idle connections are dropped before the servers' own 5 s idle
    # timeout: reusing one a server has just closed fails the request.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    runs = []
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        for level in levels:
            for target, steps in targets.items():
                warmup = Level(level.concurrency, level.concurrency * 4, 2.0)
                await load(session, steps, warmup)
                cpu_before = cpu_seconds(proxy_pid)
                latencies, errors, wall = await load(session, steps, level)
                cpu_after = cpu_seconds(proxy_pid)
                runs.append(_run(target, level, latencies, errors, wall, cpu_before, cpu_after))
    return runs


def _run(
    target: str,
    level: Level,
    latencies: list[float],
    errors: int,
    wall: float,
    cpu_before: float | None,
    cpu_after: float | None,
) -> Run:
    ms = sorted(x * 1000 for x in latencies)
    cpu = None
    if target == "proxy" and cpu_before is not None and cpu_after is not None:
        cpu = round((cpu_after - cpu_before) * 1000 / max(1, len(ms)), 3)
    return Run(
        target=target,
        concurrency=level.concurrency,
        requests=len(ms),
        errors=errors,
        seconds=round(wall, 3),
        rps=round(len(ms) / wall, 1),
        p50_ms=round(statistics.median(ms), 3),
        p99_ms=round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3),
        proxy_cpu_ms_per_request=cpu,
    )


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Added latency per level and the headline numbers."""
    by = {(r.target, r.concurrency): r for r in runs}
    levels = sorted({r.concurrency for r in runs})
    added = {
        c: {
            "p50_added_ms": round(by["proxy", c].p50_ms - by["direct", c].p50_ms, 3),
            "p99_added_ms": round(by["proxy", c].p99_ms - by["direct", c].p99_ms, 3),
            "p50_added_vs_pd_ms": round(by["proxy", c].p50_ms - by["direct_pd", c].p50_ms, 3),
        }
        for c in levels
    }
    return {
        "added": added,
        "p50_added_vs_pd_ms_c1": added[1]["p50_added_vs_pd_ms"],
        "headline": {
            "p50_added_ms_c1": added[1]["p50_added_ms"],
            "p99_added_ms_c32": added[32]["p99_added_ms"],
            "proxy_rps": max(by["proxy", c].rps for c in levels),
            "direct_rps": max(by["direct", c].rps for c in levels),
        },
    }


def table(runs: list[Run], summary: dict[str, Any]) -> str:
    """One row per level and target; what the proxy adds next to its rows."""
    header = [
        "clients", "target", "req/s", "p50 ms", "p99 ms", "added p50/p99 ms",
        "added p50 vs P+D ms", "proxy CPU ms/req", "errors",
    ]  # fmt: skip
    rows = [header]
    for r in runs:
        added = summary["added"][r.concurrency]
        proxied = r.target == "proxy"
        rows.append([
            str(r.concurrency), r.target, f"{r.rps:,.0f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}",
            f"{added['p50_added_ms']:.2f} / {added['p99_added_ms']:.2f}" if proxied else "",
            f"{added['p50_added_vs_pd_ms']:.2f}" if proxied else "",
            f"{r.proxy_cpu_ms_per_request:.2f}" if r.proxy_cpu_ms_per_request else "",
            str(r.errors),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def run(levels: Sequence[Level]) -> tuple[list[Run], dict[str, Any]]:
    """Start the fake engines and the proxy, measure, stop them."""
    with tempfile.TemporaryDirectory(prefix="fabric-proxy-bench-") as name, ExitStack() as stack:
        tmp = Path(name)
        urls = {}
        for role in ("prefill", "decode"):
            port = free_port()
            log = tmp / f"{role}.log"
            proc = stack.enter_context(process(fake_engine(role, port, free_port(), tmp), log))
            urls[role] = f"http://{HOST}:{port}"
            wait_ready(f"{urls[role]}/health", proc, log)
        proxy_port = free_port()
        config = write_topology(tmp, urls["prefill"], urls["decode"], proxy_port)
        log = tmp / "proxy.log"
        proxy = stack.enter_context(
            process([sys.executable, "-m", "fabric.cli", "proxy", str(config)], log)
        )
        proxy_url = f"http://{HOST}:{proxy_port}"
        wait_ready(f"{proxy_url}/fabric/status", proxy, log)
        steps = targets(urls["prefill"], urls["decode"], proxy_url)
        runs = _run_loop(measure(steps, levels, proxy.pid))
    return runs, summarize(runs)


def _run_loop(main: Any) -> list[Run]:
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runs: list[Run] = runner.run(main)
    return runs


def main(argv: Sequence[str] | None = None, results_dir: Path | None = None) -> None:
    """Run the benchmark; print the table, save JSON, end with the headline JSON line."""
    p = argparse.ArgumentParser(prog="benchmarks/proxy.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few requests per level (smoke test)")
    p.add_argument("--results-dir", type=Path, default=results_dir, help="where JSON goes")
    ns = p.parse_args(argv)
    levels = QUICK if ns.quick else FULL
    runs, summary = run(levels)
    print(table(runs, summary))
    print(f"({os.cpu_count()} CPUs shared by the load generator, the proxy and both fake engines)")
    added = summary["added"][1]
    print(
        f"added p50 at 1 client: {added['p50_added_ms']:.3f} ms vs direct (one call to the "
        f"fake decoder), {summary['p50_added_vs_pd_ms_c1']:.3f} ms vs direct_pd (the client "
        "calling P then D itself)"
    )
    if ns.results_dir is not None:
        ns.results_dir.mkdir(parents=True, exist_ok=True)
        path = ns.results_dir / f"proxy-{datetime.date.today().isoformat()}.json"
        record = {
            "quick": ns.quick,
            "cpus": os.cpu_count(),
            "levels": [asdict(level) for level in levels],
            "runs": [asdict(r) for r in runs],
            **summary,
        }
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path}")
    print(json.dumps(summary["headline"]), flush=True)


if __name__ == "__main__":
    main(results_dir=Path(__file__).with_name("results"))
