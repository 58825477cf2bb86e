"""Command line of ``fabric bench transfer`` (the sweep of :mod:`fabric.bench.sweep`).

    fabric bench transfer --quick
    fabric bench transfer --geometry llama3-8b,deepseek-mla --chunk-tokens 64,256 \\
        --batch 1,4 --transport nixl,tcp --memory dram --progress off --reps 5
    fabric bench transfer --out results/mine.json      # and results/mine.png

Axis options take comma-separated lists; the defaults sweep every value.
``--quick`` runs a fixed small plan (``fabric.bench.sweep_plan.QUICK``,
under 2 minutes on a 2-core VM) and refuses axis options.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

from fabric.bench import parse_config
from fabric.bench.fullpath import FullPathOptions
from fabric.bench.geometry import PRESETS
from fabric.bench.sweep_plan import (
    CHUNK_TOKENS,
    MEMORY_KINDS,
    PATHS,
    QUICK,
    TRANSPORTS,
    Grid,
    SweepConfig,
)
from fabric.errors import ConfigError

AXES = ("geometry", "chunk_tokens", "batch", "transport", "memory", "progress")
PROGRESS = {"off": (False,), "on": (True,), "both": (False, True)}


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(w) for w in _words(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fabric bench transfer",
        description="KV transfer sweep: fabric's full path vs raw NIXL, page-granular NIXL, memcpy",
    )
    p.add_argument("--quick", action="store_true", help="small fixed plan, under 2 minutes")
    p.add_argument("--geometry", type=_words, help=f"presets (default all: {','.join(PRESETS)})")
    p.add_argument("--chunk-tokens", type=_ints, help=f"default {','.join(map(str, CHUNK_TOKENS))}")
    p.add_argument("--batch", type=_ints, help="chunks per WRITE (default 1,4)")
    p.add_argument("--transport", type=_words, help=f"fabric's transport ({','.join(TRANSPORTS)})")
    p.add_argument("--memory", type=_words, help=f"{','.join(MEMORY_KINDS)} (vram needs CUDA)")
    p.add_argument("--progress", choices=sorted(PROGRESS), help="NIXL progress thread (both)")
    p.add_argument("--tokens", type=int, help="tokens per transfer (default 2048)")
    p.add_argument("--reps", type=int, help="timed repetitions per path (default 5, quick 3)")
    p.add_argument("--paths", type=_words, help=f"paths to measure (default {','.join(PATHS)})")
    p.add_argument("--out", type=Path, help="JSON path or directory (default benchmarks/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def config_from_args(ns: argparse.Namespace) -> SweepConfig:
    """The sweep the options ask for; raises ConfigError."""
    given = [a for a in AXES if getattr(ns, a) is not None]
    base = QUICK if ns.quick else SweepConfig()
    if ns.quick and given:
        raise ConfigError(f"--quick runs a fixed plan; drop --{given[0].replace('_', '-')}")
    grids = base.grids
    if not ns.quick:
        default = Grid()
        grids = (
            Grid(
                geometries=ns.geometry or default.geometries,
                chunk_tokens=ns.chunk_tokens or default.chunk_tokens,
                batches=ns.batch or default.batches,
                transports=ns.transport or default.transports,
                memories=ns.memory or default.memories,
                progress=PROGRESS[ns.progress] if ns.progress else default.progress,
            ),
        )
    return SweepConfig(
        grids=grids,
        tokens=ns.tokens or base.tokens,
        reps=ns.reps or base.reps,
        paths=ns.paths or base.paths,
        quick=ns.quick,
    )


def output_paths(out: Path | None, results_dir: Path) -> tuple[Path, Path]:
    """(JSON, PNG) paths: ``--out`` as a file (``.json``) or a directory."""
    if out is not None and out.suffix == ".json":
        return out, out.with_suffix(".png")
    folder = out or results_dir
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = folder / f"transfer-sweep-{stamp}.json"
    return json_path, json_path.with_suffix(".png")


def main(argv: list[str] | None = None, results_dir: Path = Path("benchmarks/results")) -> int:
    """``fabric bench transfer``: run, print the table, save JSON and PNG, end with the headline."""
    from rich.console import Console

    from fabric.bench.report import print_summary, sweep_progress
    from fabric.bench.sweep import run_sweep
    from fabric.bench.sweep_plan import plan_sweep

    ns, config = parse_config(build_parser(), argv, config_from_args)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # NOTE: rich assumes 80 columns in a pipe
    plan = plan_sweep(config)
    if not plan.points:
        console.print("nothing to run: every point was skipped")
        for skip in plan.skipped:
            console.print(f"  {skip['geometry']} {skip['chunk_tokens']}t: {skip['reason']}")
        return 2
    with sweep_progress(plan, Console(stderr=True)) as hooks:
        result = run_sweep(config, plan, FullPathOptions(), hooks)
    print_summary(result, console)
    json_path, png_path = output_paths(ns.out, results_dir)
    _save(result, json_path, None if ns.no_plot else png_path, console)
    sys.stdout.flush()
    print(json.dumps(result["headline"]))
    return 1 if result["errors"] else 0


def _save(result: dict[str, Any], json_path: Path, png_path: Path | None, console: Any) -> None:
    from fabric.bench.plot import PlotUnavailable, plot_sweep

    if png_path is not None:
        try:
            result["plot"] = str(plot_sweep(result, png_path))
        except PlotUnavailable as exc:
            console.print(f"[yellow]no plot:[/yellow] {exc}")
        except ValueError as exc:
            console.print(f"no plot: {exc}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"saved {json_path}" + (f" and {result['plot']}" if "plot" in result else ""))
