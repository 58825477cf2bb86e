"""The transfer sweep: planning, CLI options, headline, table, plot, and one real point."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fabric.bench import serve_cli, sweep_cli
from fabric.bench.geometry import PRESETS, cache_shape, paged_cache, preset
from fabric.bench.plot import PlotUnavailable, plot_sweep, series
from fabric.bench.sweep import headline
from fabric.bench.sweep_plan import QUICK, Grid, SweepConfig, SweepPoint, headline_point, plan_sweep
from fabric.errors import ConfigError
from fabric.transfer.nixl_plane import nixl_available


def no_cuda() -> bool:
    return False


# ---------------------------------------------------------------- geometry
def test_presets_cover_the_issue_geometries() -> None:
    assert preset("tiny").bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert preset("tiny-kv-heavy").bytes_per_token == preset("llama3-8b").bytes_per_token
    assert preset("llama3-8b").bytes_per_token == 128 * 1024
    assert preset("llama3-70b").bytes_per_token == 2 * 80 * 8 * 128 * 2
    mla = preset("deepseek-mla")
    assert (mla.num_layers, mla.num_kv_heads, mla.head_dim, mla.mla) == (61, 1, 576, True)
    assert mla.bytes_per_token == 61 * 576 * 2  # one latent, not K and V
    assert cache_shape(mla, "flash", 10, 16) == (10, 16, 576)


def test_pattern_fill_makes_every_segment_distinct() -> None:
    import torch

    def raw(tensor: torch.Tensor) -> np.ndarray:
        return tensor.view(-1).view(torch.uint8).numpy()

    storage, views = paged_cache(preset("tiny"), "flash", 8, 16, seed=3)
    rows = raw(storage).reshape(-1, 16 * 2 * 64 * 2)
    assert len({bytes(r) for r in rows}) == len(rows)
    again, _ = paged_cache(preset("tiny"), "flash", 8, 16, seed=3)
    assert np.array_equal(raw(again), raw(storage))  # NOTE: bytes; bf16 NaN != NaN
    assert len(views) == 4 and tuple(views[0].shape) == (2, 8, 16, 2, 64)


# ---------------------------------------------------------------- planning
def test_quick_plan_has_the_headline_point_and_skips_vram_without_cuda() -> None:
    plan = plan_sweep(QUICK, has_cuda=no_cuda)
    point = headline_point(plan.points)
    assert point == SweepPoint("llama3-8b", "dram", False, "nixl", 256, 1)
    assert any(s["memory"] == "vram" and "CUDA" in s["reason"] for s in plan.skipped)
    assert not any(p.memory == "vram" for p in plan.points)
    assert QUICK.reps <= 3 and QUICK.quick


def test_vram_is_planned_when_cuda_is_there() -> None:
    plan = plan_sweep(QUICK, has_cuda=lambda: True)
    assert any(p.memory == "vram" for p in plan.points)


def test_plan_groups_points_by_receiver_and_runs_nixl_before_tcp() -> None:
    grid = Grid(
        geometries=("tiny", "llama3-8b"),
        chunk_tokens=(16, 256),
        batches=(1, 4),
        transports=("tcp", "nixl"),
        memories=("dram",),
        progress=(True, False),
    )
    plan = plan_sweep(SweepConfig(grids=(grid,)), has_cuda=no_cuda)
    keys = [key for key, _ in plan.suites()]
    assert len(keys) == len(set(keys)) == 4  # 2 geometries x progress on/off
    assert not any(p.transport == "tcp" and p.progress_thread for p in plan.points)
    for _, points in plan.suites():
        transports = [p.transport for p in points]
        assert transports == sorted(transports, key=["nixl", "tcp"].index)
    assert len(plan.points) == len(set(plan.points))


def test_plan_skips_batches_longer_than_the_transfer() -> None:
    grid = Grid(
        geometries=("tiny",),
        chunk_tokens=(256, 1024),
        batches=(1, 4),
        transports=("nixl",),
        memories=("dram",),
        progress=(False,),
    )
    plan = plan_sweep(SweepConfig(grids=(grid,), tokens=2048), has_cuda=no_cuda)
    assert SweepPoint("tiny", "dram", False, "nixl", 1024, 4) not in plan.points
    assert [s["reason"] for s in plan.skipped] == ["4 chunks of 1024 tokens exceed 2048 tokens"]


@pytest.mark.parametrize(
    "kwargs",
    [{"geometries": ("llama4",)}, {"transports": ("rdma",)}, {"batches": (0,)}],
)
def test_grid_rejects_unknown_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Grid(**kwargs)


# ---------------------------------------------------------------- command line
def test_old_options_still_parse() -> None:
    ns = sweep_cli.build_parser().parse_args(
        [
            "--geometry",
            "llama3-8b",
            "--tokens",
            "1024",
            "--chunk-tokens",
            "256",
            "--reps",
            "2",
            "--progress",
            "both",
            "--out",
            "x.json",
        ]
    )
    config = sweep_cli.config_from_args(ns)
    (grid,) = config.grids
    assert grid.geometries == ("llama3-8b",) and grid.chunk_tokens == (256,)
    assert grid.progress == (False, True)
    assert (config.tokens, config.reps) == (1024, 2)
    assert sweep_cli.output_paths(ns.out, Path("r")) == (Path("x.json"), Path("x.png"))


def test_quick_refuses_axis_options() -> None:
    ns = sweep_cli.build_parser().parse_args(["--quick", "--geometry", "tiny"])
    with pytest.raises(ConfigError, match="--geometry"):
        sweep_cli.config_from_args(ns)


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (sweep_cli.main, ["--quick", "--geometry", "tiny"], "--quick runs a fixed plan"),
        (serve_cli.main, ["--max-tokens", "0"], "max_tokens: must be >= 1"),
    ],
)
def test_a_bad_option_exits_2_with_usage_and_the_message(
    main: Any, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: ") and message in err


def test_default_output_is_a_dated_pair_in_the_results_dir(tmp_path: Path) -> None:
    json_path, png_path = sweep_cli.output_paths(None, tmp_path)
    assert json_path.parent == tmp_path and json_path.name.startswith("transfer-sweep-")
    assert png_path == json_path.with_suffix(".png")


# ---------------------------------------------------------------- results
def fake_result() -> dict[str, Any]:
    """A sweep result of made-up numbers in the real format."""
    points = []
    for chunk in (16, 64, 256):
        for transport in ("nixl", "tcp"):
            gbps = {"full": chunk / 100, "raw": chunk / 50, "page": 2.0, "push": 3.0, "memcpy": 9.0}
            points.append(
                {
                    **SweepPoint("llama3-8b", "dram", False, transport, chunk, 1).__dict__,
                    "paths": {
                        k: {"gbps": v, "best_gbps": 2 * v, "ms": 1.0, "latency_ms": 0.1}
                        for k, v in gbps.items()
                    },
                    "bytes_match": {"page": True, "full": True},
                    "shared_baselines": transport == "tcp",
                    "full_vs_raw": 0.5,
                }
            )
    suite = {
        "geometry": "llama3-8b",
        "memory": "dram",
        "progress_thread": False,
        "bytes": 1 << 28,
        "raw_whole": {"gbps": 6.4, "ms": 40.0},
    }
    return {
        "created": "now",
        "machine": {"cpus": 2, "loadavg": [0.5, 0.5, 0.5]},
        "loadavg_end": [0.5, 0.5, 0.5],
        "elapsed_s": 1.0,
        "points": points,
        "suites": [suite],
        "skipped": [],
        "errors": [],
    }


def test_headline_is_full_over_raw_at_256_tokens() -> None:
    result = fake_result()
    points = [
        SweepPoint(**{k: r[k] for k in SweepPoint.__dataclass_fields__}) for r in result["points"]
    ]
    out = headline(result, headline_point(points))
    assert out["full_vs_raw_256"] == 0.5 and out["full_vs_raw_best_256"] == 0.5
    assert out["full_vs_raw_whole_256"] == round(2.56 / 6.4, 3)
    assert out["bytes_match"] is True
    assert out["faster_256"] == "staged" and out["faster_vs_page_256"] == 1.28
    assert out["direct_vs_page_256"] is None  # NOTE: not measured at that point
    assert headline(result, None) == {"full_vs_raw_256": None}
    json.dumps(out)


def test_headline_picks_the_faster_of_fabrics_two_paths() -> None:
    result = fake_result()
    for row in result["points"]:
        row["paths"]["direct"] = {**row["paths"]["page"], "gbps": 3.0}
    points = [
        SweepPoint(**{k: r[k] for k in SweepPoint.__dataclass_fields__}) for r in result["points"]
    ]
    out = headline(result, headline_point(points))
    assert out["faster_256"] == "direct" and out["direct_vs_page_256"] == 1.5
    assert out["faster_vs_page_256"] == 1.5 and out["full_vs_page_256"] == 1.28
    for row in result["points"]:  # NOTE: within 5%: a tie keeps the staged path
        row["paths"]["direct"]["gbps"] = row["paths"]["full"]["gbps"] * 1.04
    out = headline(result, headline_point(points))
    assert out["faster_256"] == "tie" and out["faster_vs_page_256"] == 1.28


def test_the_pick_is_auto_s_rule_on_the_senders_cpu_and_the_batch_latency() -> None:
    """What ``direct_reads: auto`` would keep: the lower sender CPU per
    transfer plus one-batch latency; None without both paths' CPU."""
    result = fake_result()
    for row in result["points"]:
        paths = row["paths"]
        paths["full"]["cpu_ms"] = {"sender": 133.0, "receiver": 89.0}
        paths["direct"] = {**paths["full"], "cpu_ms": {"sender": 44.0, "receiver": 134.0}}
    points = [
        SweepPoint(**{k: r[k] for k in SweepPoint.__dataclass_fields__}) for r in result["points"]
    ]
    out = headline(result, headline_point(points))
    assert out["picked_256"] == "direct" and out["picked_vs_page_256"] == 1.28
    for row in result["points"]:  # NOTE: 44 + 120 ms against 133 + 0.1: staged
        row["paths"]["direct"]["latency_ms"] = 120.0
    assert headline(result, headline_point(points))["picked_256"] == "staged"
    for row in result["points"]:
        del row["paths"]["direct"]["cpu_ms"]
    assert headline(result, headline_point(points))["picked_256"] is None


def test_table_has_a_row_per_point() -> None:
    from rich.console import Console

    from fabric.bench.report import print_summary

    console = Console(record=True, width=200)
    print_summary(fake_result(), console)
    text = console.export_text()
    assert text.count("llama3-8b") >= 6 and "tcp*" in text


def test_plot_series_and_png(tmp_path: Path) -> None:
    lines = series(fake_result())["llama3-8b"]
    assert lines["full"] == [(16, 0.16), (64, 0.64), (256, 2.56)]
    assert "full (tcp)" in lines and "raw (tcp)" not in lines
    out = plot_sweep(fake_result(), tmp_path / "sweep.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_says_when_matplotlib_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match="pip install"):
        plot_sweep(fake_result(), tmp_path / "x.png")


# ---------------------------------------------------------------- full path pieces
def test_pack_hashed_matches_pack_and_the_store_checksum() -> None:
    import types

    import torch

    from fabric.bench.fullpath import ChunkPacker, FullPathOptions, layer_groups
    from fabric.kv import KVLayout, pack
    from fabric.store import checksum

    _, views = paged_cache(preset("tiny-kv-heavy"), "flash", 8, 16, seed=1)
    layout = KVLayout.from_tensors(views)
    ids = np.array([5, 2, 7], dtype=np.int64)
    groups = layer_groups(layout, len(ids), 200_000)
    assert sum(n for _, n in groups) == 32 and len(groups) > 1
    side = types.SimpleNamespace(views=views, layout=layout)
    packer = ChunkPacker(side, FullPathOptions(piece_bytes=200_000))  # type: ignore[arg-type]
    got = torch.zeros(layout.chunk_nbytes(3), dtype=torch.uint8)
    nbytes, digest = packer.pack_hashed(ids, got)
    want = torch.zeros_like(got)
    assert pack(views, layout, ids, want) == nbytes
    assert bool((got == want).all()) and digest == checksum(want)


# ---------------------------------------------------------------- one real point
@pytest.mark.nixl
@pytest.mark.skipif(not nixl_available(), reason="no nixl")
@pytest.mark.timeout(120)
def test_one_real_point_moves_the_right_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric.bench.sweep import run_sweep

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    grid = Grid(
        geometries=("tiny",),
        chunk_tokens=(64,),
        batches=(2,),
        transports=("nixl", "tcp"),
        memories=("dram",),
        progress=(False,),
    )
    config = SweepConfig(grids=(grid,), tokens=256, reps=1)
    result = run_sweep(config, plan_sweep(config, has_cuda=no_cuda))
    assert result["errors"] == []
    nixl, tcp = result["points"]
    assert nixl["bytes"] == 256 * PRESETS["tiny"].bytes_per_token
    assert nixl["bytes_match"] == {"page": True, "full": True, "direct": True}
    assert tcp["bytes_match"] == {"full": True}  # page was measured with the NIXL point
    assert set(nixl["paths"]) == {"full", "direct", "raw", "page", "push", "memcpy"}
    assert set(tcp["paths"]) == {"full", "raw", "page", "push", "memcpy"}  # NOTE: NIXL only
    for row in (nixl, tcp):
        assert all(p["gbps"] > 0 for p in row["paths"].values())
    assert nixl["faster"] in ("staged", "direct", "tie") and tcp["faster"] == "staged"
    assert nixl["direct_reader"] in ("mapped", "in place")  # NOTE: one host: not through UCX
    assert tcp["shared_baselines"] and tcp["paths"]["raw"] == nixl["paths"]["raw"]
    assert result["headline"] == {"full_vs_raw_256": None}
    json.dumps(result)
