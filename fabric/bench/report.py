"""Rich output of the transfer sweep: a progress bar while it runs, a table after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from fabric.bench.sweep import SweepHooks
    from fabric.bench.sweep_plan import Plan

TABLE_PATHS = ("full", "direct", "raw", "page", "push", "memcpy")


@contextmanager
def sweep_progress(plan: Plan, console: Console) -> Iterator[SweepHooks]:
    """Hooks that drive a rich progress bar over ``plan``'s points."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from fabric.bench.sweep import SweepHooks

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting", total=len(plan.points))

        def on_suite(key: tuple[str, str, bool]) -> None:
            progress.update(task, description=f"starting receiver for {key[0]} {key[1]}")

        def on_done(point: Any, row: dict[str, Any] | None) -> None:
            progress.advance(task)
            if row is None:
                console.print(f"[red]failed[/red] {point.label()}")

        yield SweepHooks(
            on_suite=on_suite,
            on_point=lambda p: progress.update(task, description=p.label()),
            on_done=on_done,
        )


def sweep_table(result: dict[str, Any]) -> Table:
    """One row per point: GB/s per path, full/raw, latencies, byte checks."""
    from rich.table import Table

    table = Table(title="KV transfer sweep (GB/s; latency = one batch alone, ms)")
    for name in ("geometry", "chunk", "batch", "transport", "mem", "prog"):
        table.add_column(name)
    for path in TABLE_PATHS:
        table.add_column(path, justify="right")
    for name in (
        "full/raw",
        "faster",
        "picked",
        "read",
        "full lat",
        "raw lat",
        "cpu full/direct/raw",
        "ok",
    ):
        table.add_column(name, justify="right")
    for row in result["points"]:
        paths = row["paths"]
        gbps = [f"{paths[p]['gbps']:.2f}" if p in paths else "-" for p in TABLE_PATHS]
        lat = [f"{paths[p]['latency_ms']:.2f}" if p in paths else "-" for p in ("full", "raw")]
        ratio = row.get("full_vs_raw")
        table.add_row(
            row["geometry"],
            str(row["chunk_tokens"]),
            str(row["batch"]),
            row["transport"] + ("*" if row["shared_baselines"] else ""),
            row["memory"],
            "on" if row["progress_thread"] else "off",
            *gbps,
            f"{ratio:.2f}" if ratio is not None else "-",
            row.get("faster") or "-",
            row.get("picked") or "-",
            row.get("direct_reader") or "-",
            *lat,
            "/".join(_cpu_ms(paths.get(p)) for p in ("full", "direct", "raw")),
            "yes" if all(row["bytes_match"].values()) else "NO",
        )
    table.caption = (
        "* raw/page/memcpy shared with the NIXL point of the same settings; "
        "cpu: sender + receiver CPU ms per transfer; faster: fabric's staged (full) "
        "or direct path, by median GB/s; picked: the one direct_reads auto keeps "
        "(the lower sender CPU per transfer + one-batch latency); read: how the direct "
        "path's receiver read (mapped: out of the sender's shared memory, in place: "
        "process_vm_readv, ucx: NIXL READ)"
    )
    return table


def _cpu_ms(path: dict[str, Any] | None) -> str:
    if path is None or "cpu_ms" not in path:
        return "-"
    return f"{path['cpu_ms']['sender'] + path['cpu_ms']['receiver']:.0f}"


def print_summary(result: dict[str, Any], console: Console) -> None:
    """The table, the suites' whole-transfer ceilings, skipped points and errors."""
    console.print(sweep_table(result))
    for suite in result["suites"]:
        console.print(
            f"{suite['geometry']} {suite['memory']} progress-"
            f"{'on' if suite['progress_thread'] else 'off'}: {suite['bytes'] / 2**20:.0f} MiB "
            f"per transfer, raw one WRITE {suite['raw_whole']['gbps']:.2f} GB/s"
        )
    reasons: dict[str, list[str]] = {}
    for skip in result["skipped"]:
        label = f"{skip['geometry']} {skip['chunk_tokens']}t x{skip['batch']} {skip['memory']}"
        reasons.setdefault(skip["reason"], []).append(label)
    for reason, labels in reasons.items():
        more = f" (+{len(labels) - 3} more)" if len(labels) > 3 else ""
        console.print(f"skipped {len(labels)}: {reason}: {', '.join(labels[:3])}{more}")
    for err in result["errors"]:
        console.print(f"[red]error[/red] {err['geometry']} {err['chunk_tokens']}t: {err['error']}")
    machine = result["machine"]
    console.print(
        f"{result['elapsed_s']} s; load average {machine['loadavg'][0]:.2f} at start, "
        f"{result['loadavg_end'][0]:.2f} at end ({machine['cpus']} CPUs)"
    )
