"""``fabric bench transfer``: the transfer benchmark over a sweep of settings.

For every point of the plan (:mod:`fabric.bench.sweep_plan`: geometry x
chunk tokens x chunks per WRITE x fabric transport x memory kind x NIXL
progress thread) it moves one transfer of ``tokens`` tokens between two
processes each way of :mod:`fabric.bench.transfer` and reports, per path:

    gbps        bytes of the whole transfer / median seconds
    best_gbps   the same over the fastest run
    ms          median seconds of the whole transfer
    latency_ms  median seconds to move one batch alone (idle pipeline)
    cpu_ms      median CPU time per whole transfer, sender and receiver
                processes (all threads); on 2 cores, wall >= their sum / 2
                (push's includes packing its chunks, done before its timing)

``direct`` is fabric's direct path (the receiver reads the sender's
blocks into its own and verifies them, :mod:`fabric.kv.direct`), measured
over NIXL from host memory; each row says which of fabric's two paths,
staged (``full``) or direct, was ``faster`` there (or a ``tie``, within
:data:`TIE`), and which fabric ``picked``: the rule the vLLM connector's
``direct_reads: auto`` applies to what it measures on a link
(:func:`fabric.integrations.vllm.paths.preferred`: the lower sender CPU
per transfer plus one-batch latency); the headline does the same at its
point.
``push`` here runs until the receiver verified every chunk. raw, page and
memcpy do not involve fabric's transport: a TCP point shares them with the
NIXL point of the same settings (``shared_baselines``). Each suite also
records ``raw_whole``: one WRITE of the whole transfer. The paths take
turns, one run each per round. After the timed runs, page and full each run
once more into a cleared receiver cache, whose blocks are then compared with
the sender's (``bytes_match``). The headline point gets ``headline_reps``.

Output: a table, ``transfer-sweep-<stamp>.json`` and ``.png`` (GB/s against
chunk size, :mod:`fabric.bench.plot`), and as the last stdout line one JSON
object, the headline: ``{"full_vs_raw_256": ..}`` for Llama-3-8B at
256-token chunks.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from fabric.bench.fullpath import FullPathOptions
from fabric.bench.sweep_plan import Plan, SweepConfig, SweepPoint, headline_point
from fabric.bench.transfer import Suite, machine_info, median, repeat
from fabric.bench.transfer_side import SideArgs
from fabric.integrations.vllm.paths import preferred

FORMAT_VERSION = 1
BASELINES = ("raw", "page", "memcpy")
FABRIC_PATHS = {"full": "staged", "direct": "direct"}
"""fabric's two ways to move a chunk, by their path names here."""


@dataclass
class SweepHooks:
    """Callbacks for progress display; all optional."""

    on_suite: Callable[[tuple[str, str, bool]], None] = lambda key: None
    on_point: Callable[[SweepPoint], None] = lambda point: None
    on_done: Callable[[SweepPoint, dict[str, Any] | None], None] = lambda p, r: None


@dataclass
class SweepRun:
    """State of one sweep while it runs."""

    config: SweepConfig
    options: FullPathOptions
    hooks: SweepHooks
    points: list[dict[str, Any]] = field(default_factory=list)
    suites: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    baselines: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)


def run_sweep(
    config: SweepConfig,
    plan: Plan,
    options: FullPathOptions | None = None,
    hooks: SweepHooks | None = None,
) -> dict[str, Any]:
    """Measure every point of ``plan``; the result document (see module docstring)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    run = SweepRun(config, options or FullPathOptions(), hooks or SweepHooks())
    started, machine = time.monotonic(), machine_info()
    for key, points in plan.suites():
        run.hooks.on_suite(key)
        _run_suite(run, key, points)
    measured = [SweepPoint(**_point_fields(p)) for p in run.points]
    result = {
        "benchmark": "transfer-sweep",
        "format": FORMAT_VERSION,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": config.to_json(),
        "full_path": run.options.model_dump(),
        "machine": machine,
        "loadavg_end": list(os.getloadavg()),
        "elapsed_s": round(time.monotonic() - started, 1),
        "suites": run.suites,
        "points": run.points,
        "skipped": plan.skipped,
        "errors": run.errors,
    }
    result["headline"] = headline(result, headline_point(measured))
    return result


def _run_suite(run: SweepRun, key: tuple[str, str, bool], points: list[SweepPoint]) -> None:
    geometry, memory, progress = key
    first = points[0]
    args = SideArgs(
        geometry=geometry,
        kind=run.config.kind,
        tokens=run.config.tokens,
        chunk_tokens=first.chunk_tokens,
        block_size=run.config.block_size,
        progress_thread=progress,
        transport=first.transport,
        memory=memory,
    )
    started = time.monotonic()
    try:
        suite = Suite(args, run.options)
    except Exception as exc:
        for point in points:
            _record_error(run, point, exc)
        return
    left = list(points)
    try:
        info = _suite_info(suite, run.config.reps)
        info["setup_s"] = round(time.monotonic() - started, 2)
        run.suites.append(info)
        while left:
            run.hooks.on_point(left[0])
            run.hooks.on_done(left[0], _measure_or_record(suite, left[0], run))
            left.pop(0)
        info["elapsed_s"] = round(time.monotonic() - started, 2)
    except Exception as exc:  # NOTE: the suite itself broke: the points left all fail
        for point in left:
            _record_error(run, point, exc)
    finally:
        suite.close()


def _measure_or_record(suite: Suite, point: SweepPoint, run: SweepRun) -> dict[str, Any] | None:
    """The point's row (also appended to ``run.points``), or None after recording the error."""
    try:
        row = measure_point(suite, point, run)
    except Exception as exc:
        _record_error(run, point, exc)
        return None
    run.points.append(row)
    return row


def _suite_info(suite: Suite, reps: int) -> dict[str, Any]:
    """The suite's settings and its whole-transfer raw WRITE (one descriptor)."""
    n, nbytes = suite.num_chunks, suite.side.total_bytes
    seconds = median(repeat(lambda: suite.time_raw(n, n), reps))
    args = suite.side.args
    return {
        "geometry": args.geometry,
        "memory": args.memory,
        "progress_thread": args.progress_thread,
        "bytes": nbytes,
        "bytes_per_token": suite.side.layout.bytes_per_token,
        "layout": suite.side.layout.kind.value,
        "raw_whole": {"gbps": nbytes / seconds / 1e9, "ms": seconds * 1e3},
    }


def measure_point(suite: Suite, point: SweepPoint, run: SweepRun) -> dict[str, Any]:
    """Every path of ``run.config.paths`` at ``point``: GB/s, ms, latency; byte checks.

    NOTE: the paths take turns, one run each per round, so a burst of load
    from another process hits every path alike instead of one path's runs.
    """
    suite.use_fabric(point.transport, point.chunk_tokens)
    count, batch = suite.num_chunks, point.batch
    shared = run.baselines.get(point.baseline_key)
    timers = _timers(suite)
    paths: dict[str, Any] = {}
    measured = []
    for name in (n for n in timers if n in run.config.paths):
        if shared is not None and name in BASELINES and name in shared["paths"]:
            paths[name] = shared["paths"][name]
        else:
            measured.append(name)
    reps = run.config.reps
    if headline_point([point]) is not None:
        reps = max(reps, run.config.headline_reps)
    paths.update(_measure_paths(suite, {n: timers[n] for n in measured}, batch, count, reps))
    checks = {}
    for name in (n for n in ("page", "full", "direct") if n in measured):
        suite.receiver.ask("clear")  # NOTE: so a path that wrote nothing cannot match
        timers[name](batch, count)
        checks[name] = suite.digests_match()
    if shared is None:
        run.baselines[point.baseline_key] = {"paths": paths}
    row = {
        **asdict(point),
        "tokens": run.config.tokens,
        "bytes": suite.side.total_bytes,
        "chunk_bytes": suite.chunk_bytes(0),
        "num_chunks": count,
        "paths": paths,
        "bytes_match": checks,
        "shared_baselines": shared is not None,
    }
    if "full" in paths and "raw" in paths:
        row["full_vs_raw"] = round(paths["full"]["gbps"] / paths["raw"]["gbps"], 3)
    if "direct" in measured:
        row["direct_reader"] = suite.direct_reader
    row["faster"] = faster_path(paths)
    row["picked"] = picked_path(paths)
    return row


TIE = 0.05
"""Medians closer than this (relative) are a tie: fabric keeps the staged path."""


def faster_path(paths: dict[str, Any]) -> str | None:
    """fabric's path with the higher median GB/s at a point: "staged" (full)
    or "direct", "tie" within :data:`TIE`; the only one measured when the
    other was not; None if neither."""
    have = {name: paths[key]["gbps"] for key, name in FABRIC_PATHS.items() if key in paths}
    if len(have) == 2 and abs(have["staged"] - have["direct"]) <= TIE * max(have.values()):
        return "tie"
    return max(have, key=lambda name: have[name]) if have else None


def picked_path(paths: dict[str, Any]) -> str | None:
    """The path ``direct_reads: auto`` would keep here: "staged" (full) or
    "direct" by :func:`~fabric.integrations.vllm.paths.preferred`, the lower
    sender CPU per transfer plus one-batch latency (the push's tail); None
    unless both were measured with their CPU."""
    costs = {}
    for key, name in FABRIC_PATHS.items():
        entry = paths.get(key) or {}
        cpu, latency = (entry.get("cpu_ms") or {}).get("sender"), entry.get("latency_ms")
        if cpu is None or latency is None:
            return None
        costs[name] = (float(cpu) / 1000, float(latency) / 1000)  # NOTE: seconds
    return preferred(costs)


def _timers(suite: Suite) -> dict[str, Callable[[int, int], float]]:
    timers = {
        "memcpy": suite.time_memcpy,
        "raw": suite.time_raw,
        "page": suite.time_page,
        "push": lambda b, c: suite.time_push(b, c)[1],
        "full": suite.time_full,
    }
    if suite.direct:
        timers["direct"] = suite.time_direct
    return timers


def _measure_paths(
    suite: Suite,
    timers: dict[str, Callable[[int, int], float]],
    batch: int,
    count: int,
    reps: int,
) -> dict[str, dict[str, Any]]:
    """Whole transfers (with CPU times) and one-batch latencies, round-robin."""
    nbytes = suite.moved_bytes(count)
    one = min(batch, count)
    for timer in timers.values():
        timer(batch, count)  # warm-up: first touch, connection setup
    whole: dict[str, list[tuple[float, float, float]]] = {name: [] for name in timers}
    latency: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(reps):
        for name, timer in timers.items():
            whole[name].append(_timed_with_cpu(suite, timer, batch, count))
    for _ in range(reps):
        for name, timer in timers.items():
            latency[name].append(timer(batch, one))
    out = {}
    for name, runs in whole.items():
        seconds = median([r[0] for r in runs])
        out[name] = {
            "gbps": round(nbytes / seconds / 1e9, 4),
            "best_gbps": round(nbytes / min(r[0] for r in runs) / 1e9, 4),
            "ms": round(seconds * 1e3, 3),
            "latency_ms": round(median(latency[name]) * 1e3, 3),
            "cpu_ms": {
                "sender": round(median([r[1] for r in runs]) * 1e3, 2),
                "receiver": round(median([r[2] for r in runs]) * 1e3, 2),
            },
        }
    return out


def _timed_with_cpu(
    suite: Suite, timer: Callable[[int, int], float], batch: int, count: int
) -> tuple[float, float, float]:
    """(seconds ``timer`` reports, sender CPU s, receiver CPU s) of one run."""
    tx0, rx0 = suite.cpu_seconds()
    seconds = timer(batch, count)
    tx1, rx1 = suite.cpu_seconds()
    return seconds, tx1 - tx0, rx1 - rx0


def _record_error(run: SweepRun, point: SweepPoint, exc: BaseException) -> None:
    run.errors.append(
        {
            **asdict(point),
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=5),
        }
    )


def _point_fields(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in SweepPoint.__dataclass_fields__}


def find_point(result: dict[str, Any], point: SweepPoint | None) -> dict[str, Any] | None:
    if point is None:
        return None
    want = asdict(point)
    for row in result["points"]:
        if all(row[k] == v for k, v in want.items()):
            return dict(row)
    return None


def headline(result: dict[str, Any], point: SweepPoint | None) -> dict[str, Any]:
    """The issue's numbers at ``point`` (Llama-3-8B, 256-token chunks); None if not run."""
    row = find_point(result, point)
    out: dict[str, Any] = {"full_vs_raw_256": None}
    if row is None:
        return out
    g = {name: p["gbps"] for name, p in row["paths"].items()}
    suite = next(
        (
            s
            for s in result["suites"]
            if (s["geometry"], s["memory"], s["progress_thread"])
            == (row["geometry"], row["memory"], row["progress_thread"])
        ),
        None,
    )

    def ratio(a: str, b: float | None) -> float | None:
        return round(g[a] / b, 3) if a in g and b else None

    out["full_vs_raw_256"] = ratio("full", g.get("raw"))
    best = {name: row["paths"].get(name, {}).get("best_gbps") for name in ("full", "raw")}
    if best["full"] and best["raw"]:
        out["full_vs_raw_best_256"] = round(best["full"] / best["raw"], 3)
    if suite is not None:
        out["full_vs_raw_whole_256"] = ratio("full", suite["raw_whole"]["gbps"])
    out["full_vs_page_256"] = ratio("full", g.get("page"))
    out["direct_vs_page_256"] = ratio("direct", g.get("page"))
    if "direct_reader" in row:
        out["direct_reader_256"] = row["direct_reader"]
    chosen = faster_path(row["paths"])
    out["faster_256"] = chosen
    if chosen is not None:
        # NOTE: a tie keeps the staged path, the one the connector runs
        key = next((k for k, v in FABRIC_PATHS.items() if v == chosen), "full")
        out["faster_vs_page_256"] = ratio(key, g.get("page"))
    picked = picked_path(row["paths"])
    out["picked_256"] = picked
    if picked is not None:
        key = next(k for k, v in FABRIC_PATHS.items() if v == picked)
        out["picked_vs_page_256"] = ratio(key, g.get("page"))
    out["push_vs_raw_256"] = ratio("push", g.get("raw"))
    for name in ("full", "direct", "raw", "page", "push", "memcpy"):
        if name in g:
            out[f"{name}_gbps_256"] = round(g[name], 3)
    for name in ("full", "direct", "raw"):
        cpu = row["paths"].get(name, {}).get("cpu_ms")
        if cpu:
            out[f"{name}_cpu_ms_256"] = round(cpu["sender"] + cpu["receiver"], 1)
    out["batch"] = row["batch"]
    out["bytes_match"] = all(row["bytes_match"].values())
    out["loadavg_1m"] = round(result["machine"]["loadavg"][0], 2)
    return out
