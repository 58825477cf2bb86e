"""Child processes with owners: start, health-wait, stop by process group.

``ManagedProcess`` runs one command in its own session (so its process group
holds everything it spawns, e.g. vLLM's EngineCore) with stdout and stderr in
a log file. ``stop()`` signals the command, then kills the group, never a name;
``kill_group()`` kills what a command that exited left behind (vLLM's
EngineCore outlives an API server killed alone: it has no parent-death
check). The helpers build
what a real vLLM CPU engine needs on a machine with no GPU and no internet
: a free loopback port, an offline environment
whose files stay in one work dir, and the ``serve`` command line.

    ManagedProcess(argv, log_path=..., env=..., cwd=...)
      .pid / .alive() / .returncode / .log_tail() / .wait() / .stop()
      .group_pids() / .kill_group() / .wait_group_gone(timeout)
    wait_http_ok(url, timeout, proc=None)
    free_port(host="127.0.0.1") -> int
    engine_env(workdir, cpu_cores=None, kv_cache_gib=1) -> dict[str, str]
    vllm_serve_command(model_dir, port, ...) -> list[str]

Errors: ``ProcessExited`` (the process died while being waited on, with its
log tail) and ``StartTimeout`` (it never answered), both ``LaunchError``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from fabric.errors import LaunchError, ProcessExited, StartTimeout

__all__ = [
    "LaunchError",
    "ManagedProcess",
    "ProcessExited",
    "StartTimeout",
    "engine_env",
    "free_port",
    "vllm_serve_command",
    "wait_http_ok",
]

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_SEED = 0
LOG_TAIL_BYTES = 4000
GROUP_KILL_WAIT_S = 10.0  # for processes killed with SIGKILL to exit (a GPU's may take seconds)
POLL_S = 0.05


class ManagedProcess:
    """One command in its own process group, logging to ``log_path``.

    Starts at construction (like ``subprocess.Popen``). Use as a context
    manager, or call ``stop()``; ``__del__`` is only a backstop.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        name: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.name = name or Path(self.argv[0]).name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        """Process id of the command, which is also its process group id."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once it exited (negative: killed by that signal), else None."""
        return self._popen.poll()

    def alive(self) -> bool:
        """True while the command itself has not exited."""
        return self._popen.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command to exit; ``subprocess.TimeoutExpired`` on timeout."""
        return self._popen.wait(timeout)

    def log_tail(self, num_bytes: int = LOG_TAIL_BYTES) -> str:
        """The last ``num_bytes`` of the log, decoded leniently."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - num_bytes))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the command, wait up to ``timeout`` s, then SIGKILL its process group.

        Children left in the group after the leader exited are killed too, and
        waited for (at most ``GROUP_KILL_WAIT_S``). Returns the exit status.
        Safe to call twice.

        NOTE: SIGTERM goes to the leader only: a vLLM server stops its own
        EngineCore and workers, and drains first (:mod:`fabric.launch.drain`);
        a SIGTERM to the whole group makes its workers exit at once and fails
        the requests in flight.
        """
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self._popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout)
        # NOTE: even after a clean exit, spawned children may linger in the group.
        self.kill_group()
        try:
            status: int | None = self._popen.wait(5.0)
        except subprocess.TimeoutExpired:
            status = None
        self.wait_group_gone(GROUP_KILL_WAIT_S)
        return status

    def group_pids(self) -> list[int]:
        """The live processes of its process group (zombies aside), the leader while it runs.

        Empty once the group is gone. A process group id stays reserved while
        any member lives, so once the leader was reaped a process whose pid is
        that id is a newcomer, and means the group is gone.
        """
        pgid = self._popen.pid
        reaped = self._popen.poll() is not None
        try:
            pids = _group_members(pgid)
        except OSError:  # no /proc: whether the kernel still knows the group
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return []
            return [pgid]
        return [] if reaped and pgid in pids else pids

    def kill_group(self) -> list[int]:
        """SIGKILL every process of its group, the leader too; the pids it had.

        A no-op once the group is gone. Does not wait (``wait_group_gone``).
        """
        pids = self.group_pids()
        if pids:
            self._signal_group(signal.SIGKILL)
        return pids

    def wait_group_gone(self, timeout: float) -> bool:
        """Until no process of its group is left (True), or ``timeout`` s passed (False)."""
        deadline = time.monotonic() + timeout
        while self.group_pids():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, sig)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        # NOTE: a backstop: the group is killed even when the leader is gone
        # (what it spawned may still run).
        if getattr(self, "_popen", None) is not None:
            with contextlib.suppress(Exception):
                self.kill_group()

    def __repr__(self) -> str:
        return f"ManagedProcess(name={self.name!r}, pid={self.pid}, alive={self.alive()})"


def _group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose process group is ``pgid``, from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                # NOTE: after the command name in parentheses: state, ppid, pgrp.
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            members.append(int(entry.name))
    return members


def wait_http_ok(
    url: str, timeout: float, proc: ManagedProcess | None = None, *, interval: float = 0.25
) -> None:
    """Poll ``GET url`` until it answers 200.

    Raises ``ProcessExited`` at once if ``proc`` dies meanwhile, and
    ``StartTimeout`` (with ``proc``'s log tail) after ``timeout`` seconds.
    """
    import httpx

    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if proc is not None and not proc.alive():
                raise ProcessExited(
                    f"{proc.name} (pid {proc.pid}) exited with {proc.returncode} "
                    f"before {url} answered; log {proc.log_path}:\n{proc.log_tail()}"
                )
            try:
                status = client.get(url).status_code
                if status == 200:
                    return
                last = f"HTTP {status}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                tail = f"; log {proc.log_path}:\n{proc.log_tail()}" if proc is not None else ""
                raise StartTimeout(
                    f"{url} did not answer 200 within {timeout:.0f} s (last: {last}){tail}"
                )
            time.sleep(interval)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICK_SPAN = 20_000  # ports below the ephemeral range that free_port picks from
PICK_TOP = 30_000  # ... and below Kubernetes' NodePorts (30000-32767, which a bind cannot see)
PICK_TRIES = 64
_pick = random.SystemRandom()  # NOTE: not the global random: vLLM seeds it, every process alike
_handed: collections.deque[int] = collections.deque(maxlen=256)  # this process's recent picks


def ephemeral_ports() -> tuple[int, int]:
    """The ports the OS hands to binds of port 0 and outgoing connections."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # NOTE: Linux's default
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago.

    Picked at random below the OS's ephemeral range, so that while the
    caller has not bound it yet, no bind to port 0 elsewhere (an engine's
    own ZMQ, gloo or UCX listeners starting meanwhile) and no outgoing
    connection can take it, and below Kubernetes' NodePort range; never one
    this process handed out lately (its caller may not have bound it yet).
    A port the OS picks when that leaves no room, or no pick was free. One
    port: a TP engine's ranks bind ``kv_port + rank`` above it, unchecked."""
    low, _ = ephemeral_ports()
    top = min(low, PICK_TOP)
    first = max(1024, top - PICK_SPAN)
    if top - first >= 1024:
        for _ in range(PICK_TRIES):
            port = _pick.randrange(first, top)
            if port in _handed:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))  # NOTE: no SO_REUSEADDR: a port in use fails here
                except OSError:
                    continue
            _handed.append(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def engine_env(
    workdir: Path,
    *,
    cpu_cores: str | None = None,
    kv_cache_gib: int = 1,
    torch_compile: bool = False,
) -> dict[str, str]:
    """The environment of a vLLM CPU engine: offline, loopback, files under ``workdir``.

    Starts from ``os.environ``. ``cpu_cores`` (e.g. ``"0"`` or ``"0-1"``) pins
    the engine's OpenMP threads; ``kv_cache_gib`` sizes its KV pool.
    ``torch_compile=False`` sets ``TORCH_COMPILE_DISABLE=1``: even with
    ``--enforce-eager``, vLLM compiles a sampler helper with inductor on the
    first request that asks for logprobs, which stalls that request for
    13-22 s in every new engine process on this machine.
    """
    workdir = Path(workdir).resolve()
    dirs = {
        "TMPDIR": workdir / "tmp",
        "VLLM_RPC_BASE_PATH": workdir / "rpc",
        "VLLM_CACHE_ROOT": workdir / "cache" / "vllm",
        "TORCHINDUCTOR_CACHE_DIR": workdir / "cache" / "inductor",
    }
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({name: str(path) for name, path in dirs.items()})
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "UCX_NET_DEVICES": "lo",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cpu_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
    if not torch_compile:
        env["TORCH_COMPILE_DISABLE"] = "1"
    return env


def vllm_serve_command(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    seed: int = DEFAULT_SEED,
    served_model_name: str | None = None,
    host: str = "127.0.0.1",
    dtype: str = "bfloat16",
) -> list[str]:
    """``vllm serve`` for a small, deterministic, quick-to-start engine on ``host``:``port``.

    Runs through ``fabric.launch.vllm_main`` so it works with vllm-cpu too.
    """
    argv = [
        sys.executable,
        "-m",
        "fabric.launch.vllm_main",
        "serve",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enforce-eager",
        "--seed",
        str(seed),
        "--max-model-len",
        str(max_model_len),
        "--disable-uvicorn-access-log",
    ]
    if served_model_name is not None:
        argv += ["--served-model-name", served_model_name]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config, separators=(",", ":"))]
    argv += list(extra_args)
    return argv
