"""PNG of a transfer sweep: GB/s against chunk size, one line per path.

One panel per geometry; the lines are the NIXL, DRAM, progress-thread-off
points at the smallest batch measured (the sweep's main series), plus
fabric's full path over TCP where it was measured. matplotlib is imported
here only (``pip install 'kv-fabric[bench]'``); without it :func:`plot_sweep`
raises :class:`PlotUnavailable` with that advice.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from fabric.bench.sweep_plan import HEADLINE_GEOMETRY

PATH_STYLES = {
    "full": ("fabric full (pack+push+unpack)", "-", "o"),
    "push": ("fabric push (packed ahead)", "--", "s"),
    "raw": ("raw NIXL contiguous", "-", "^"),
    "page": ("NIXL page-granular", "-.", "v"),
    "memcpy": ("memcpy (one process)", ":", "x"),
}


class PlotUnavailable(ImportError):
    """matplotlib is not installed (the message says how to get it)."""


Series = dict[str, list[tuple[int, float]]]


def series(result: dict[str, Any]) -> dict[str, Series]:
    """geometry -> line label -> [(chunk tokens, GB/s)], sorted by chunk size."""
    main = [r for r in result["points"] if r["memory"] == "dram" and not r["progress_thread"]]
    out: dict[str, Series] = defaultdict(lambda: defaultdict(list))
    for geometry in sorted({r["geometry"] for r in main}):
        rows = [r for r in main if r["geometry"] == geometry]
        batch = min(r["batch"] for r in rows)
        for row in (r for r in rows if r["batch"] == batch):
            for path, values in row["paths"].items():
                if row["transport"] == "nixl":
                    out[geometry][path].append((row["chunk_tokens"], values["gbps"]))
                elif path in ("full", "push"):
                    out[geometry][f"{path} ({row['transport']})"].append(
                        (row["chunk_tokens"], values["gbps"])
                    )
    return {g: {k: sorted(v) for k, v in s.items()} for g, s in out.items()}


def plot_sweep(result: dict[str, Any], out: Path) -> Path:
    """Write the sweep's plot to ``out`` (PNG); raises PlotUnavailable."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(
            "matplotlib is not installed, so no plot was drawn: "
            "pip install 'kv-fabric[bench]' (or pip install matplotlib)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(result)
    if not data:
        raise ValueError("the sweep has no DRAM, progress-off points to plot")
    order = sorted(data, key=lambda g: (g != HEADLINE_GEOMETRY, g))
    fig, axes = plt.subplots(1, len(order), figsize=(5 * len(order), 4.6), squeeze=False)
    legend: dict[str, Any] = {}
    for ax, geometry in zip(axes[0], order, strict=True):
        chunks: set[int] = set()
        for label, points in data[geometry].items():
            base = label.split(" ")[0]
            name, style, marker = PATH_STYLES.get(base, (base, "-", "."))
            xs, ys = zip(*points, strict=True)
            chunks.update(xs)
            (line,) = ax.plot(xs, ys, linestyle=style, marker=marker)
            legend.setdefault(name + label[len(base) :], line)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(chunks), [str(c) for c in sorted(chunks)])
        ax.minorticks_off()
        ax.set_xlabel("chunk size (tokens)")
        ax.set_ylabel("GB/s")
        ax.set_title(geometry)
        ax.grid(True, alpha=0.3)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=4, fontsize=8)
    machine = result.get("machine", {})
    fig.suptitle(
        f"KV transfer, {machine.get('cpus', '?')} CPUs, "
        f"load {machine.get('loadavg', [0])[0]:.1f}, {result.get('created', '')}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
