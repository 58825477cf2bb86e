"""The pure parts of ``benchmarks/soak.py --chaos`` (no vLLM): histogram
quantiles from Prometheus buckets, table gauges, RSS growth per process
incarnation, and a real kill of a real process with its restart timed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from fabric.launch.process import free_port


@pytest.fixture(scope="module")
def chaos() -> ModuleType:
    return importlib.import_module("benchmarks.chaos")


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


def test_rss_growth_of_a_process_alive_at_warm_up_counts_from_then(chaos: ModuleType) -> None:
    samples = [
        {"t": 0, "rss": {"p/2": 1000}},  # warm-up
        {"t": 30, "rss": {"p/2": 1100}},
        {"t": 120, "rss": {"p/2": 1150}},
    ]
    assert chaos.rss_growth(samples, settle_s=60, min_life_s=100)[0] == {}
    growth, _ = chaos.rss_growth(samples, settle_s=60, min_life_s=100, settled={"p/2"})
    assert growth == {"p/2": pytest.approx(0.15)}  # not judged from t=60 on


def test_every_engine_is_killed_once_before_any_is_killed_twice(chaos: ModuleType) -> None:
    import random

    engines = [{"name": n, "pid": 1} for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")]
    for seed in range(20):
        c = chaos.Chaos(Path("up.json"), every_s=1, seed=seed)
        rng = random.Random(seed)
        for _ in range(8):
            victim = c._next_victim(engines, rng)
            c.kills.append(chaos.Kill(victim["name"], 1, 0.0))
        names = [k.victim for k in c.kills]
        assert sorted(names[:4]) == sorted(names[4:]) == sorted(e["name"] for e in engines)


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


def test_the_bare_copy_of_an_engine_is_vllm_without_fabric_on_a_port_of_its_own(
    chaos: ModuleType, tmp_path: Path
) -> None:
    config = '{"kv_connector":"FabricConnector","kv_role":"kv_both"}'
    argv = [
        "/venv/bin/python", "-m", "fabric.launch.vllm_main", "serve", "/m/tiny",
        "--host", "127.0.0.1", "--port", "50247", "--enforce-eager",
        "--kv-transfer-config", config, "--middleware=x.Y", "--seed", "0",
    ]  # fmt: skip
    bare, endpoint, port = chaos.bare_command(argv, tmp_path)

    assert endpoint is None and port not in (None, 50247)
    assert bare[:4] == ["/venv/bin/python", "-m", "fabric.launch.vllm_main", "serve"]
    assert "--kv-transfer-config" not in bare and config not in bare
    assert bare[-2:] == ["--port", str(port)] and "50247" not in bare
    rest = ["/m/tiny", "--host", "127.0.0.1", "--enforce-eager", "--middleware=x.Y"]
    assert bare[4:-2] == [*rest, "--seed", "0"]
    store = ["/py", "-m", "fabric.cli", "store", "serve", "--port", "7000", "--disk-path", "/kv"]
    bare_store, store_endpoint, _ = chaos.bare_command(store, tmp_path)
    assert store_endpoint == tmp_path / "bare-store.endpoint"
    assert bare_store[-6:] == [
        "--port", "0", "--endpoint-file", str(store_endpoint),
        "--disk-path", str(tmp_path / "bare-store-disk"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no bare copy"):
        chaos.bare_command(["/bin/sleep", "1"], tmp_path)


def test_a_store_kill_times_a_bare_store_started_beside_its_restart(
    chaos: ModuleType, tmp_path: Path
) -> None:
    """A real store SIGKILLed: the bare copy (same command, port 0, its own
    endpoint file) is started at the kill, timed until it serves, and stopped."""
    run = tmp_path / "run"
    run.mkdir()
    state = tmp_path / "up.json"
    endpoint = run / "store.endpoint"
    serve = [
        sys.executable, "-m", "fabric.cli", "store", "serve", "--mem-gib", "0.0625",
        "--port", "0", "--endpoint-file", str(endpoint), "--transport", "tcp",
    ]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        endpoint.unlink(missing_ok=True)
        procs.append(subprocess.Popen(serve, start_new_session=True, stderr=subprocess.DEVNULL))
        while not endpoint.exists():
            assert procs[-1].poll() is None
            time.sleep(0.1)
        state.write_text(json.dumps({"engines": [], "store": {"pid": procs[-1].pid}}))

    async def scenario() -> None:
        scratch = tmp_path / "bare"
        scratch.mkdir()
        c = chaos.Chaos(state, every_s=0.1, store_at=1, log=lambda _: None, scratch=scratch)
        stop = asyncio.Event()
        runner = asyncio.create_task(c.run(stop))
        while not c.kills:
            await asyncio.sleep(0.01)
        c.every_s = 3600  # NOTE: one kill only
        await asyncio.to_thread(procs[0].wait)
        await asyncio.to_thread(start)  # the stand-in supervisor
        stop.set()
        await asyncio.wait_for(runner, 120)
        kill = c.kills[0]
        assert kill.victim == "store" and kill.new_pid == procs[1].pid
        assert kill.bare_error is None and kill.bare_start_s is not None
        assert kill.bare_start_s > 0
        assert kill.to_dict()["bare_start_s"] == round(kill.bare_start_s, 1)

    try:
        start()
        asyncio.run(asyncio.wait_for(scenario(), 180))
        assert procs[0].returncode == -9
        # NOTE: the bare copy served on a port of its own, and was stopped
        # (its endpoint file removed at its stop, nothing answers on its port)
        log = (tmp_path / "bare" / "bare-store-1.log").read_text()
        port = int(log.split("serving on tcp://127.0.0.1:", 1)[1].split()[0])
        assert not (tmp_path / "bare" / "bare-store.endpoint").exists()
        assert f":{port}" not in endpoint.read_text()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_only_errors_no_kill_explains_count_against_a_chaos_run(chaos: ModuleType) -> None:
    soak = importlib.import_module("benchmarks.soak")
    kills = [
        chaos.Kill("decode-0", 1, at=100.0, serving_at=150.0),
        chaos.Kill("store", 2, at=300.0),
    ]
    # in a window (100..180), after it (200), before any kill (50), a victim not back (900)
    assert soak.outside_kills([120.0, 179.0, 200.0, 50.0, 900.0], kills, 30.0) == 2
