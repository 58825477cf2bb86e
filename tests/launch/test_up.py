"""``fabric up``: commands built for vLLM, and whole runs with fake engines as the engines.

The runs go through the real code path (see :mod:`tests.launch._up`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabric.config import TopologyConfig, parse_topology
from fabric.errors import ConfigError
from fabric.launch import up
from fabric.launch.process import free_port
from tests.launch._up import (
    CRASH,
    DRAIN_FAKE,
    FAKE,
    STALL,
    UpRun,
    group_members,
    is_running,
    stream_lines,
)

# An engine that never answers /health, writes MARK.ready once its handler is
# in, and on SIGTERM writes MARK then exits only once RELEASE exists: fabric
# up's stop is under way for as long as the test wants.
SLOW_TO_STOP = (
    "import os, signal, sys, time\n"
    "mark, release = sys.argv[1], sys.argv[2]\n"
    "def stop(*args):\n"
    "    open(mark, 'w').close()\n"
    "    for _ in range(1200):\n"
    "        if os.path.exists(release):\n"
    "            break\n"
    "        time.sleep(0.05)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "open(mark + '.ready', 'w').close()\n"
    "time.sleep(120)\n"
)


def test_resolve_ports_fills_free_distinct_ports_and_keeps_given_ones() -> None:
    topology = parse_topology(
        {
            "model": "m",
            "prefill": [{}, {"port": 8100}],
            "decode": [{"url": "http://127.0.0.1:8300", "kv_port": 8301}],
            "proxy": {"port": None},
        }
    )

    resolved = up.resolve_ports(topology)

    p0, p1 = resolved.prefill
    ports = [p0.port, p0.kv_port, p1.port, p1.kv_port]
    assert None not in ports and len(set(ports)) == 4
    assert p1.port == 8100
    assert resolved.decode[0] == topology.decode[0]


def test_vllm_command_carries_the_fabric_kv_transfer_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fabric.testing.models.tiny

    built: list[tuple[Path, bool]] = []

    def make_tiny_model(out_dir: Path, *, kv_heavy: bool = False) -> Path:
        built.append((out_dir, kv_heavy))
        return out_dir

    monkeypatch.setattr(fabric.testing.models.tiny, "make_tiny_model", make_tiny_model)
    topology = parse_topology(
        {
            "model": "tiny",
            "workdir": str(tmp_path),
            "prefill": [{"port": 8100, "kv_port": 8101, "args": ["--max-num-seqs", "4"]}],
            "decode": [{"port": 8200, "kv_port": 8201, "model": "tiny-kv-heavy"}],
            "connector": {"store_mib": 64, "extra": {"pack_threads": 2}},
        }
    )

    command = up.engine_command(topology.prefill[0], topology)

    assert built == [(tmp_path / "models" / "tiny", False)]
    assert command[:4] == [sys.executable, "-m", "fabric.launch.vllm_main", "serve"]
    assert command[4] == str(tmp_path / "models" / "tiny")
    assert option(command, "--port") == "8100"
    assert option(command, "--served-model-name") == "tiny"
    assert command[-2:] == ["--max-num-seqs", "4"]
    assert json.loads(option(command, "--kv-transfer-config")) == {
        "kv_connector": "FabricConnector",
        "kv_connector_module_path": "fabric.integrations.vllm",
        "kv_role": "kv_producer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "kv_port": 8101,
            "host": "127.0.0.1",
            "chunk_tokens": 256,
            "transport": "auto",
            "reuse": True,
            "store_mib": 64,
            "pack_threads": 2,
        },
    }
    decode = up.engine_command(topology.decode[0], topology)
    assert built[-1] == (tmp_path / "models" / "tiny-kv-heavy", True)
    assert json.loads(option(decode, "--kv-transfer-config"))["kv_role"] == "kv_consumer"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"chunk_tokes": 128}, r"unknown key 'chunk_tokes'"),
        ({"layer_groups": 0}, r"layer_groups: Input should be greater than 0"),
        ({"shared_store": "127.0.0.1:9", "reuse": False}, r"shared_store: needs reuse"),
    ],
    ids=["typo", "bad-value", "across-fields"],
)
def test_a_bad_connector_setting_fails_before_any_engine_starts(
    tmp_path: Path, extra: dict[str, object], match: str
) -> None:
    """What the engine's connector would refuse at its start (inside vLLM, as
    an engine that dies) is refused by fabric up first, naming the engine
    and the key; no engine is started."""
    topology = parse_topology(
        {
            "workdir": str(tmp_path),
            "prefill": [{"port": 8100, "kv_port": 8101, "command": [*FAKE]}],
            "decode": [{"port": 8200, "kv_port": 8201, "command": [*FAKE]}],
            "connector": {"extra": extra},
        }
    )
    runs: list[Any] = []

    with pytest.raises(ConfigError, match=r"prefill-0: connector: kv_connector_extra_config"):
        up.start_engines(topology, runs)
    with pytest.raises(ConfigError, match=match):
        up.kv_transfer_config(topology.decode[0], topology.connector)
    assert runs == []


def test_real_model_names_go_to_vllm_as_they_are(tmp_path: Path) -> None:
    topology = parse_topology(
        {
            "model": "org/model",
            "workdir": str(tmp_path),
            "prefill": [{"port": 8100, "kv_port": 8101}],
            "decode": [{"port": 8200, "kv_port": 8201}],
        }
    )
    command = up.engine_command(topology.prefill[0], topology)
    assert command[4] == "org/model" and "--served-model-name" not in command


def test_engine_environment_pins_and_adds_env(tmp_path: Path) -> None:
    topology = parse_topology(
        {
            "model": "m",
            "workdir": str(tmp_path),
            "prefill": [{"cpu_cores": "1", "cuda_visible_devices": "2", "env": {"X": "y"}}],
            "decode": [{}],
        }
    )
    env = up.engine_environment(topology.prefill[0], topology)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["CUDA_VISIBLE_DEVICES"], env["X"]) == (
        "1",
        "2",
        "y",
    )
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_command_template_is_filled(tmp_path: Path) -> None:
    topology = parse_topology(
        {
            "model": "fake",
            "workdir": str(tmp_path),
            "prefill": [
                {"port": 8100, "kv_port": 8101, "command": [*FAKE, "--json={kv_transfer_config}"]}
            ],
            "decode": [{"port": 8200, "kv_port": 8201}],
        }
    )
    command = up.engine_command(topology.prefill[0], topology)
    assert command[:5] == [sys.executable, "-m", "fabric.testing.fake_engine", "--port", "8100"]
    assert option(command, "--kv-port") == "8101" and option(command, "--model") == "fake"
    kv_config = json.loads(command[-1].removeprefix("--json="))
    assert kv_config["kv_connector_extra_config"]["kv_port"] == 8101


def option(command: list[str], name: str) -> str:
    """The value after ``name`` in a command line."""
    return command[command.index(name) + 1]


@pytest.fixture
def runs() -> Iterator[list[UpRun]]:
    started: list[UpRun] = []
    yield started
    for run in started:
        run.kill_all()


def test_up_serves_through_the_proxy_and_stops_everything_on_sigterm(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    run = UpRun(tmp_path, FAKE, FAKE)
    runs.append(run)

    url = run.wait_line(r"proxy serving at (http://\S+)").group(1)
    state = json.loads((run.workdir / "run" / "up.json").read_text())
    response = httpx.post(
        f"{url}/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3}, timeout=10
    )
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    status = run.stop(signal.SIGTERM)

    assert response.status_code == 200, response.text
    assert "fabric_proxy_fallbacks_total 0\n" in metrics
    assert state["proxy_url"] == url
    assert [e["name"] for e in state["engines"]] == ["prefill-0", "decode-0"]
    pids = [e["pid"] for e in state["engines"]]
    assert sorted(pids) == sorted(run.engine_pids())
    assert status == 0
    assert not any(is_running(pid) for pid in pids)
    assert not run.leftovers()
    assert not (run.workdir / "run" / "up.json").exists()
    assert (run.workdir / "logs" / "decode-0.log").exists()


def test_engine_that_dies_at_start_stops_everything_and_shows_its_log(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    run = UpRun(tmp_path, FAKE, CRASH)
    runs.append(run)

    status = run.process.wait(60)

    stderr = "".join(run.stderr)
    assert status == 1
    assert "decode-0" in stderr and "engine decode-0 is broken" in stderr
    assert run.engine_pids() and not run.leftovers()


def test_engine_that_never_answers_is_a_bounded_failure(tmp_path: Path, runs: list[UpRun]) -> None:
    run = UpRun(tmp_path, FAKE, STALL, startup_timeout_s=2)
    runs.append(run)

    status = run.process.wait(60)

    assert status == 1
    assert "decode-0 not healthy within 2 s" in "".join(run.stderr)
    assert not run.leftovers()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_while_waiting_for_engines_stops_them(
    tmp_path: Path, runs: list[UpRun], sig: signal.Signals
) -> None:
    run = UpRun(tmp_path, FAKE, STALL)
    runs.append(run)
    run.wait_line(r"waiting for 2 engines")

    status = run.stop(sig)

    assert status == 0
    assert len(run.engine_pids()) == 2
    assert not run.leftovers()


def test_up_starts_the_shared_store_first_and_stops_it_last(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    run = UpRun(tmp_path, FAKE, FAKE, store={"mem_gib": 0.01})
    runs.append(run)

    endpoint = run.wait_line(r"shared store serving on (tcp://\S+)").group(1)
    run.wait_line(r"proxy serving at")
    state = run.state()
    from fabric.transfer.store_client import StoreClient

    with StoreClient(endpoint) as client:
        stats = client.stats()
    status = run.stop(signal.SIGTERM)

    assert stats["num_slots"] == 1  # up, no engine attached (the fake engines do not)
    assert state["store"]["first_start_s"] > 0
    assert all(e["first_start_s"] > 0 for e in state["engines"])
    assert status == 0
    stderr = "".join(run.stderr)
    assert stderr.index("started store") < stderr.index("started prefill-0")
    pids = run.engine_pids()  # the store's pid is logged the same way
    assert len(pids) == 3 and not run.leftovers()
    assert (run.workdir / "logs" / "store.log").exists()
    assert not (run.workdir / "run" / "store.endpoint").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--drain-timeout-s", "soon"], "argument --drain-timeout-s: must be a number of seconds"),
        (["--drain-timeout-s", "-1"], "argument --drain-timeout-s: must be a finite number >= 0"),
        (["--restart-backoff-s", "0"], "argument --restart-backoff-s: must be a finite number > 0"),
        (
            ["--restart-backoff-s", "5", "--restart-backoff-max-s", "1"],
            "max-s: must be >= --restart",
        ),
    ],
)
def test_bad_up_flags_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    from fabric.cli import main

    try:
        status = main(["up", str(tmp_path / "never-read.yaml"), *args])
    except SystemExit as exc:  # argparse
        status = int(exc.code or 0)
    assert status == 2
    assert message in capsys.readouterr().err


def test_sigusr1_while_the_engines_start_is_ignored(tmp_path: Path, runs: list[UpRun]) -> None:
    run = UpRun(tmp_path, FAKE, STALL, startup_timeout_s=5)
    runs.append(run)
    run.wait_line(r"waiting for 2 engines")

    run.process.send_signal(signal.SIGUSR1)  # nothing is stopped yet: nothing to restart
    status = run.process.wait(60)

    assert status == 1  # it went on waiting, until its startup timeout
    assert "decode-0 not healthy within 5 s" in "".join(run.stderr)
    assert not run.leftovers()


def test_signals_while_stopping_are_ignored_and_nothing_is_left(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    mark, release = tmp_path / "got-sigterm", tmp_path / "release"
    slow = ["{python}", "-c", SLOW_TO_STOP, str(mark), str(release)]
    run = UpRun(tmp_path, FAKE, slow)
    runs.append(run)
    run.wait_line(r"waiting for 2 engines")
    wait_for_file(tmp_path / "got-sigterm.ready")
    run.process.send_signal(signal.SIGTERM)
    run.wait_line(r"fabric up: stopping")
    wait_for_file(mark)  # the engine is stopping, and fabric up waits for it

    for sig in (signal.SIGUSR1, signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        run.process.send_signal(sig)
    running_while_stopping = run.process.poll() is None
    release.touch()
    status = run.process.wait(60)

    assert running_while_stopping
    assert status == 0
    assert not run.leftovers()


def wait_for_file(path: Path) -> None:
    for _ in range(600):  # a hang guard
        if path.exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_up_help_says_how_to_run_it_under_systemd(capsys: pytest.CaptureFixture[str]) -> None:
    from fabric.cli import main

    with pytest.raises(SystemExit):
        main(["up", "--help"])
    assert "KillMode=mixed" in capsys.readouterr().out


# --- fabric up in this process (to reach into it) ----------------------------


def in_process_topology(tmp_path: Path, decode: list[str]) -> TopologyConfig:
    return parse_topology(
        {
            "model": "fake",
            "workdir": str(tmp_path / "work"),
            "prefill": [{"command": FAKE, "port": free_port(), "kv_port": free_port()}],
            "decode": [{"command": decode, "port": free_port(), "kv_port": free_port()}],
            "proxy": {"port": free_port(), "health_interval_s": 0.5},
        }
    )


def started_pids(caplog: pytest.LogCaptureFixture) -> list[int]:
    return [int(m) for m in re.findall(r"started \S+ \(pid (\d+)\)", caplog.text)]


def test_a_proxy_that_does_not_start_stops_everything_and_exits_1(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    import fabric.router

    create_app = fabric.router.create_app

    def broken_app(topology: TopologyConfig) -> Any:
        app = create_app(topology)

        @contextlib.asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            raise RuntimeError("the lifespan startup broke")
            yield

        app.router.lifespan_context = lifespan
        return app

    monkeypatch.setattr(fabric.router, "create_app", broken_app)
    caplog.set_level(logging.INFO, logger="fabric.launch.up")

    status = up.up(in_process_topology(tmp_path, FAKE), lambda line: None)

    assert status == 1
    assert "fabric up: proxy: the server did not start" in capsys.readouterr().err
    pids = started_pids(caplog)
    assert len(pids) == 2 and not any(group_members(pid) for pid in pids)


def test_an_engine_stopping_gets_the_drain_timeout_and_then_some(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # NOTE: the margin past the drain made small, so a drain longer than the
    # margin shows (a fixed stop bound shorter than the drain cuts it).
    monkeypatch.setattr(up, "STOP_MARGIN_S", 0.5, raising=False)
    monkeypatch.setattr(up, "STOP_TIMEOUT_S", 0.5, raising=False)
    caplog.set_level(logging.INFO, logger="fabric.launch.up")
    topology = in_process_topology(tmp_path, [*DRAIN_FAKE, "--token-delay-s", "0.1"])
    ready = threading.Event()
    decode_url = f"http://127.0.0.1:{topology.decode[0].port}"
    body = {"model": "fake", "prompt": "drain me", "max_tokens": 20, "stream": True}  # 2 s

    def announce(line: str) -> None:
        if "proxy serving at" in line:
            ready.set()

    def client() -> list[str]:
        assert ready.wait(60), "fabric up never served"
        first = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            lines = pool.submit(stream_lines, decode_url, body, first)
            assert first.wait(30), "the stream never started"
            os.kill(os.getpid(), signal.SIGTERM)  # fabric up (this process) stops
            return lines.result(timeout=60)

    options = up.UpOptions(drain_timeout_s=5.0)
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(client)
        status = up.up(topology, announce, options)
        lines = stream.result(timeout=60)

    assert status == 0
    assert lines[-1] == "data: [DONE]" and len(lines) == 21  # the engine's drain ran its course
    assert not any(group_members(pid) for pid in started_pids(caplog))


def test_fabric_up_does_not_import_vllm() -> None:
    """fabric up checks each engine's connector settings with the connector's
    own config, whose package must not bring vLLM in (seconds of import and
    its log lines ahead of fabric up's own messages)."""
    code = (
        "import sys, fabric.cli, fabric.launch.up, fabric.integrations.vllm.config\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)[:5]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
