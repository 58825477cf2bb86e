"""ManagedProcess and the engine helpers, with plain Python children (no vLLM)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric.launch import process as process_module
from fabric.launch.process import (
    ManagedProcess,
    ProcessExited,
    StartTimeout,
    engine_env,
    free_port,
    vllm_serve_command,
    wait_http_ok,
)

SPAWNS_A_SLEEPER = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('child', child.pid, flush=True)\n"
    "time.sleep(60)\n"
)
IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def wait_for_log(proc: ManagedProcess, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in (log := proc.log_tail()):
        assert time.monotonic() < deadline, f"{text!r} never logged: {log!r}"
        time.sleep(0.05)
    return log


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie awaiting its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def test_output_goes_to_the_log_and_the_exit_status_is_kept(tmp_path: Path) -> None:
    proc = ManagedProcess(
        python("print('hello'); raise SystemExit(3)"), log_path=tmp_path / "p.log"
    )
    assert proc.wait(10) == 3
    assert not proc.alive()
    assert proc.returncode == 3
    assert "hello" in (tmp_path / "p.log").read_text()
    assert proc.stop() == 3  # stopping an exited process is harmless


def test_runs_in_its_own_process_group_with_env_and_cwd(tmp_path: Path) -> None:
    code = "import os; print(os.getpgid(0) == os.getpid(), os.getcwd(), os.environ['FABRIC_X'])"
    env = {**os.environ, "FABRIC_X": "42"}
    proc = ManagedProcess(python(code), log_path=tmp_path / "p.log", env=env, cwd=tmp_path)
    proc.wait(10)
    assert proc.log_tail().split() == ["True", str(tmp_path), "42"]


def test_stop_kills_the_whole_group(tmp_path: Path) -> None:
    with ManagedProcess(python(SPAWNS_A_SLEEPER), log_path=tmp_path / "p.log") as proc:
        child_pid = int(wait_for_log(proc, "child").split()[1])
        assert proc.alive()
    assert not proc.alive()
    deadline = time.monotonic() + 5
    while not gone(child_pid):
        assert time.monotonic() < deadline, "grandchild survived stop()"
        time.sleep(0.05)


LEAVES_A_SLEEPER = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('child', child.pid, flush=True)\n"
)  # NOTE: the leader exits at once; its child runs on in its group


def test_kill_group_kills_what_an_exited_leader_left_and_waits_for_it(tmp_path: Path) -> None:
    proc = ManagedProcess(python(LEAVES_A_SLEEPER), log_path=tmp_path / "p.log")
    assert proc.wait(10) == 0
    child_pid = int(wait_for_log(proc, "child").split()[1])

    assert proc.group_pids() == [child_pid]
    assert proc.kill_group() == [child_pid]
    assert proc.wait_group_gone(10)
    assert gone(child_pid) and proc.group_pids() == [] and proc.kill_group() == []


def test_stop_returns_once_the_group_is_gone(tmp_path: Path) -> None:
    proc = ManagedProcess(python(SPAWNS_A_SLEEPER), log_path=tmp_path / "p.log")
    child_pid = int(wait_for_log(proc, "child").split()[1])
    proc.stop(timeout=5)
    assert gone(child_pid) and proc.group_pids() == []


def test_the_backstop_kills_what_an_exited_leader_left(tmp_path: Path) -> None:
    proc = ManagedProcess(python(LEAVES_A_SLEEPER), log_path=tmp_path / "p.log")
    proc.wait(10)
    child_pid = int(wait_for_log(proc, "child").split()[1])
    assert not gone(child_pid)
    del proc  # NOTE: the last reference: __del__ runs now (CPython)
    deadline = time.monotonic() + 10
    while not gone(child_pid):  # a hang guard, not a bound
        if time.monotonic() > deadline:
            os.kill(child_pid, 9)
            raise AssertionError("the child of an exited leader survived its ManagedProcess")
        time.sleep(0.05)


CHILD = (
    "import signal, sys, time\n"
    "def said(*args):\n"
    "    print('child got SIGTERM', flush=True)\n"
    "    sys.exit()\n"
    "signal.signal(signal.SIGTERM, said)\n"
    "print('child ready', flush=True)\n"
    "time.sleep(60)\n"
)
LEADER_WAITS_FOR_ITS_CHILD = (
    "import signal, subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}])\n"
    "def stop(*args):\n"
    "    time.sleep(1.0)  # like a server stopping its workers: they are its business\n"
    "    sys.exit()\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "time.sleep(60)\n"
)


def test_stop_sends_sigterm_to_the_command_only(tmp_path: Path) -> None:
    # NOTE: a vLLM server stops its own workers; a SIGTERM to the whole group
    # makes them exit under it and fails the requests in flight.
    proc = ManagedProcess(python(LEADER_WAITS_FOR_ITS_CHILD), log_path=tmp_path / "p.log")
    wait_for_log(proc, "child ready")
    proc.stop(timeout=10)
    assert "child got SIGTERM" not in (tmp_path / "p.log").read_text()
    assert proc.returncode == 0  # its own exit, then the group was killed


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    proc = ManagedProcess(python(IGNORES_SIGTERM), log_path=tmp_path / "p.log")
    wait_for_log(proc, "ready")
    started = time.monotonic()
    assert proc.stop(timeout=0.5) == -9
    assert time.monotonic() - started < 5


def test_wait_http_ok_returns_once_the_server_answers(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with ManagedProcess(argv, log_path=tmp_path / "http.log", cwd=tmp_path) as proc:
        wait_http_ok(f"http://127.0.0.1:{port}/", timeout=20, proc=proc)


def test_wait_http_ok_fails_fast_with_the_log_tail_when_the_process_dies(tmp_path: Path) -> None:
    proc = ManagedProcess(
        python("print('boom: no model'); raise SystemExit(2)"), log_path=tmp_path / "p.log"
    )
    started = time.monotonic()
    with pytest.raises(ProcessExited, match="boom: no model"):
        wait_http_ok(f"http://127.0.0.1:{free_port()}/health", timeout=60, proc=proc)
    assert time.monotonic() - started < 10


def test_wait_http_ok_times_out(tmp_path: Path) -> None:
    with pytest.raises(StartTimeout) as info:
        wait_http_ok(f"http://127.0.0.1:{free_port()}/health", timeout=0.5)
    assert isinstance(info.value, TimeoutError)


def test_free_port_can_be_bound() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_engine_env_is_offline_loopback_and_inside_the_workdir(tmp_path: Path) -> None:
    env = engine_env(tmp_path, cpu_cores="1", kv_cache_gib=2)
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == env["DO_NOT_TRACK"] == "1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["UCX_NET_DEVICES"] == "lo"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["TORCH_COMPILE_DISABLE"] == "1"
    for name in ("TMPDIR", "VLLM_RPC_BASE_PATH", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        assert Path(env[name]).is_dir()
        assert Path(env[name]).is_relative_to(tmp_path.resolve())


def test_engine_env_leaves_binding_and_compile_alone_when_asked(tmp_path: Path) -> None:
    env = engine_env(tmp_path, torch_compile=True)
    assert env.get("VLLM_CPU_OMP_THREADS_BIND") == os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    assert env.get("TORCH_COMPILE_DISABLE") == os.environ.get("TORCH_COMPILE_DISABLE")


def test_vllm_serve_command(tmp_path: Path) -> None:
    kv = {"kv_connector": "FabricConnector", "kv_role": "kv_producer"}
    argv = vllm_serve_command(
        tmp_path, 8123, kv_transfer_config=kv, extra_args=["--max-num-seqs", "4"]
    )
    assert argv[:5] == [sys.executable, "-m", "fabric.launch.vllm_main", "serve", str(tmp_path)]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert "--enforce-eager" in argv
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == kv
    assert argv[-2:] == ["--max-num-seqs", "4"]
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    wide = vllm_serve_command(tmp_path, 8123, dtype="float32")
    assert wide[wide.index("--dtype") + 1] == "float32" and wide.count("--dtype") == 1


def test_vllm_main_reports_a_cpu_version_for_vllm() -> None:
    import importlib.metadata as metadata

    try:
        expected = metadata.version("vllm-cpu") + "+cpu"
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    code = "import fabric.launch.vllm_main, importlib.metadata as m; print(m.version('vllm'))"
    version = subprocess.run(python(code), capture_output=True, text=True, check=True).stdout
    assert version.strip() == expected


def test_free_port_picks_below_the_ephemeral_range_and_skips_a_port_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port the OS may hand to another process's bind to port 0 (an
    engine's own listeners starting meanwhile) is never picked; nor is
    one something listens on."""
    low, _ = process_module.ephemeral_ports()
    top = min(low, process_module.PICK_TOP)
    if top - process_module.PICK_SPAN < 1024:
        pytest.skip(f"ephemeral ports from {low}: free_port lets the OS pick")
    picked = [process_module.free_port() for _ in range(20)]
    assert all(top - process_module.PICK_SPAN <= port < top for port in picked)
    assert len(set(picked)) == len(picked)  # never one handed out lately
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", picked[0]))
        busy.listen()
        other = next(port for port in picked if port != picked[0])
        picks = iter([picked[0], other])
        monkeypatch.setattr(process_module._pick, "randrange", lambda a, b: next(picks))
        process_module._handed.clear()
        assert process_module.free_port() == other
