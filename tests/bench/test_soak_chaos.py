"""The pure parts of ``benchmarks/soak.py --chaos`` (no vLLM): histogram
quantiles from Prometheus buckets, table gauges, RSS growth per process
incarnation, and a real kill of a real process with its restart timed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fabric.launch.process import free_port

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chaos() -> ModuleType:
    return load("chaos")


PAGE = """\
# HELP vllm:fabric_scheduler_hold_seconds per scheduler step
vllm:fabric_scheduler_hold_seconds_bucket{engine="0",le="0.0001",model_name="tiny"} 90.0
vllm:fabric_scheduler_hold_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 98.0
vllm:fabric_scheduler_hold_seconds_bucket{engine="0",le="0.025",model_name="tiny"} 100.0
vllm:fabric_scheduler_hold_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 100.0
vllm:fabric_scheduler_hold_seconds_count{engine="0",model_name="tiny"} 100.0
vllm:fabric_table_entries{engine="0",model_name="tiny",table="scheduler_hits"} 2.0
vllm:fabric_table_entries{engine="0",model_name="tiny",table="loader_active"} 0.0
"""


def test_quantile_is_the_least_bucket_reaching_it_over_all_pages(chaos: ModuleType) -> None:
    one = chaos.parse_histogram(PAGE, chaos.HOLD_METRIC)
    assert one == {0.0001: 90.0, 0.001: 98.0, 0.025: 100.0, float("inf"): 100.0}
    assert chaos.histogram_quantile(one, 0.5) == 0.0001
    assert chaos.histogram_quantile(one, 0.99) == 0.025
    slow = {0.0001: 0.0, 0.001: 0.0, 0.025: 0.0, float("inf"): 300.0}  # another engine
    both = chaos.add_histograms([one, slow])
    assert chaos.histogram_quantile(both, 0.99) == float("inf")
    assert chaos.histogram_quantile({}, 0.99) is None
    assert chaos.parse_tables(PAGE) == {"scheduler_hits": 2.0, "loader_active": 0.0}


def test_rss_growth_is_per_incarnation_from_its_settled_value(chaos: ModuleType) -> None:
    samples = [
        {"t": 0, "rss": {"proxy/1": 100, "p/2": 1000}},
        {"t": 60, "rss": {"proxy/1": 100, "p/2": 1000}},
        {"t": 120, "rss": {"proxy/1": 105, "p/3": 5000}},  # p restarted: pid 3
        {"t": 180, "rss": {"proxy/1": 120, "p/3": 2000}},
        {"t": 240, "rss": {"proxy/1": 110, "p/3": 2100}},
        {"t": 300, "rss": {"proxy/1": 110, "p/3": 2100}},
    ]
    growth, short = chaos.rss_growth(samples, settle_s=60, min_life_s=100)
    assert growth == {"proxy/1": pytest.approx(0.2), "p/3": pytest.approx(0.05)}
    assert short == ["p/2"]  # killed before it could be judged


def test_a_killed_process_is_timed_until_its_restart_answers(
    chaos: ModuleType, tmp_path: Path
) -> None:
    """A real SIGKILL of a real process group; a stand-in supervisor
    restarts it on the same port and rewrites the state file."""
    port = free_port()
    state = tmp_path / "up.json"
    serve = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            serve, cwd=tmp_path, start_new_session=True, stderr=subprocess.DEVNULL
        )
        url = f"http://127.0.0.1:{port}"
        engines = [{"name": "prefill-0", "pid": proc.pid, "url": url}]
        state.write_text(json.dumps({"engines": engines}))
        return proc

    (tmp_path / "health").write_text("ok")  # GET /health -> 200
    first = start()
    procs = [first]

    async def scenario() -> None:
        c = chaos.Chaos(state, every_s=0.1, store_at=0, log=lambda _: None)
        stop = asyncio.Event()

        async def supervisor() -> None:
            while first.poll() is None:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            procs.append(start())

        sup = asyncio.create_task(supervisor())
        runner = asyncio.create_task(c.run(stop))
        while not c.kills:
            await asyncio.sleep(0.01)
        c.every_s = 3600  # NOTE: one kill only
        while c.kills[0].serving_at is None:
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(runner, 60)
        await sup
        kill = c.kills[0]
        assert kill.victim == "prefill-0" and kill.pid == first.pid
        assert kill.new_pid == procs[1].pid
        assert kill.restart_to_serving_s >= 0.5  # NOTE: not before the restart answered

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
        assert first.wait(5) == -9
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_only_errors_no_kill_explains_count_against_a_chaos_run(chaos: ModuleType) -> None:
    soak = load("soak")
    kills = [
        chaos.Kill("decode-0", 1, at=100.0, serving_at=150.0),
        chaos.Kill("store", 2, at=300.0),
    ]
    # in a window (100..180), after it (200), before any kill (50), a victim not back (900)
    assert soak.outside_kills([120.0, 179.0, 200.0, 50.0, 900.0], kills, 30.0) == 2
