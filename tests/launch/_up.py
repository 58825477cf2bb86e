"""``fabric up`` in a subprocess with fake engines, for the launcher tests.

Each engine's ``command`` is the fake engine (or the fake engine behind the
drain middleware, ``DRAIN_FAKE``), so no vLLM is needed; everything goes
through the real code path (``python -m fabric.cli up CONFIG``, engines
started by ``ManagedProcess``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from fabric.launch.process import free_port

FAKE = [
    "{python}", "-m", "fabric.testing.fake_engine", "--port", "{port}", "--role", "{role}",
    "--name", "{name}", "--model", "{model}", "--kv-port", "{kv_port}",
]  # fmt: skip
DRAIN_FAKE = [
    "{python}", str(Path(__file__).with_name("drain_engine.py")), "--port", "{port}",
    "--role", "{role}", "--name", "{name}", "--model", "{model}", "--kv-port", "{kv_port}",
]  # fmt: skip
HOLDER = str(Path(__file__).with_name("holder_engine.py"))
CRASH = ["{python}", "-c", "import sys; print('engine {name} is broken'); sys.exit(3)"]
STALL = ["{python}", "-c", "import time; time.sleep(60)"]


def holding(pid_file: Path, command: list[str]) -> list[str]:
    """``command`` whose leader leaves a process holding the kv_port behind
    (``holder_engine.py``; the holders' pids are appended to ``pid_file``)."""
    return ["{python}", HOLDER, "{kv_port}", str(pid_file), *command]


def broken_when(marker: str, command: list[str]) -> list[str]:
    """``command``, except that it exits 3 at once while the file ``marker`` exists."""
    line = " ".join(command)
    return ["sh", "-c", f"if [ -e {marker} ]; then echo broken; exit 3; fi; exec {line}"]


class UpRun:
    """``fabric up`` in a subprocess; whatever it started is killed at teardown."""

    def __init__(
        self,
        tmp_path: Path,
        prefill: list[Any],
        decode: list[Any],
        *,
        proxy: dict[str, Any] | None = None,
        args: list[str] | None = None,
        wrap: Callable[[list[str]], list[str]] = lambda argv: argv,
        **top: Any,
    ) -> None:
        self.workdir = tmp_path / "work"
        config = {
            "model": "fake",
            "workdir": str(self.workdir),
            "prefill": [_engine(e) for e in _engines(prefill)],
            "decode": [_engine(e) for e in _engines(decode)],
            "proxy": {"port": free_port(), "health_interval_s": 0.5, **(proxy or {})},
            **top,
        }
        path = tmp_path / "topology.yaml"
        path.write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen(
            wrap([sys.executable, "-m", "fabric.cli", "up", str(path), *(args or [])]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(
            target=self._read, args=(self.process.stdout, self.lines.put), daemon=True
        ).start()
        threading.Thread(
            target=self._read, args=(self.process.stderr, self.stderr.append), daemon=True
        ).start()
        self.url = ""

    @staticmethod
    def _read(stream: Any, put: Any) -> None:
        for line in stream:
            put(line)

    def wait_line(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """The first stdout line matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r}; stderr:\n{''.join(self.stderr)}")

    def wait_serving(self) -> str:
        """The proxy's URL, once it serves."""
        self.url = self.wait_line(r"proxy serving at (http://\S+)").group(1)
        return self.url

    def state(self) -> dict[str, Any]:
        """``WORKDIR/run/up.json``."""
        state: dict[str, Any] = json.loads((self.workdir / "run" / "up.json").read_text())
        return state

    def engine_state(self, name: str) -> dict[str, Any]:
        """One engine's entry in ``up.json``."""
        return next(e for e in self.state()["engines"] if e["name"] == name)

    def wait_state(
        self, name: str, check: Callable[[dict[str, Any]], bool], timeout: float = 60.0
    ) -> dict[str, Any]:
        """``name``'s up.json entry once ``check`` holds (``store``: the store's)."""
        deadline = time.monotonic() + timeout
        entry: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                entry = self.state()["store"] if name == "store" else self.engine_state(name)
            except (OSError, ValueError, StopIteration):
                entry = {}
            if entry and check(entry):
                return entry
            time.sleep(0.1)
        raise AssertionError(f"{name}: last {entry}; stderr:\n{''.join(self.stderr)}")

    def complete(self, prompt: str = "hi", max_tokens: int = 3, **body: Any) -> httpx.Response:
        """POST /v1/completions through the proxy."""
        body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, **body}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)

    def engine_pids(self) -> list[int]:
        """Pids of the processes it started or restarted, from its log."""
        return [int(m) for m in re.findall(r"started \S+ \(pid (\d+)\)", "".join(self.stderr))]

    def leftovers(self) -> list[int]:
        """Live processes in any process group it created (one per process it
        started: the group's id is that process's pid)."""
        return [pid for pgid in self.engine_pids() for pid in group_members(pgid)]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait for the exit status."""
        self.process.send_signal(sig)
        return self.process.wait(timeout)

    def kill_all(self) -> None:
        """Teardown backstop: kill the launcher and every process it reported."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        for pgid in self.engine_pids():
            if group_members(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)


def _engines(spec: list[Any]) -> list[Any]:
    """One engine given as its command (a list of str), or several."""
    return [spec] if spec and isinstance(spec[0], str) else spec


def _engine(spec: Any) -> dict[str, Any]:
    return spec if isinstance(spec, dict) else {"command": spec}


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose process group is ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def stream_lines(url: str, body: dict[str, Any], first: threading.Event) -> list[str]:
    """The SSE lines of a streamed completion; ``first`` is set at the first data line."""
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                first.set()
    return lines
