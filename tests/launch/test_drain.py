"""Graceful drain: the gate in process, and SIGTERM to engines behind ``EngineDrain``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabric.launch.drain import DRAIN_FILE_ENV, DRAIN_TIMEOUT_ENV, DrainGate
from fabric.launch.process import ManagedProcess, free_port, wait_http_ok
from fabric.launch.vllm_main import DRAIN_MIDDLEWARE, with_drain_args
from tests.launch._up import stream_lines

HERE = Path(__file__).parent


# --- the gate, in process -----------------------------------------------------


async def call(app: Any, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """One ASGI HTTP call: status, headers, body."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    await app(scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_gate_refuses_new_work_while_draining_and_waits_for_what_runs() -> None:
    async def scenario() -> None:
        release = asyncio.Event()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["path"] == "/slow":
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        gate = DrainGate(app, name="the test server")
        slow = asyncio.create_task(call(gate, "POST", "/slow"))
        while gate.in_flight == 0:
            await asyncio.sleep(0.01)
        gate.draining = True

        status, headers, body = await call(gate, "POST", "/v1/completions")
        health = await call(gate, "GET", "/health")
        metrics = await call(gate, "GET", "/metrics")
        timed_out = await gate.wait_idle(0.2)
        release.set()
        drained = await gate.wait_idle(30)

        assert status == 503 and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == 503 and "the test server is draining" in error["message"]
        assert health[0] == 503
        assert metrics[0] == 200  # the drain can be watched
        assert timed_out is False and drained is True
        assert (await slow)[0] == 200
        assert gate.in_flight == 0

    asyncio.run(scenario())


def test_gate_counts_a_request_that_fails_out_of_flight() -> None:
    async def scenario() -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            raise RuntimeError("boom")

        gate = DrainGate(app)
        with pytest.raises(RuntimeError):
            await call(gate, "POST", "/x")
        assert gate.in_flight == 0 and await gate.wait_idle(0)

    asyncio.run(scenario())


# --- vllm_main's arguments ----------------------------------------------------


def test_vllm_serve_gets_the_drain_middleware() -> None:
    argv = ["serve", "model", "--port", "1", "--middleware", "x.Y"]
    assert with_drain_args(argv) == [*argv, "--middleware", DRAIN_MIDDLEWARE]
    assert with_drain_args(["--version"]) == ["--version"]


# --- SIGTERM to an engine process ---------------------------------------------


@pytest.fixture
def processes() -> Iterator[list[ManagedProcess]]:
    started: list[ManagedProcess] = []
    yield started
    for process in started:
        process.stop(5)


def start_drain_engine(
    tmp_path: Path, processes: list[ManagedProcess], argv: list[str], drain_timeout_s: float = 30
) -> tuple[ManagedProcess, str]:
    port = free_port()
    env = {
        **os.environ,
        DRAIN_FILE_ENV: str(tmp_path / "engine.draining"),
        DRAIN_TIMEOUT_ENV: str(drain_timeout_s),
    }
    command = [sys.executable, *[a.replace("{port}", str(port)) for a in argv]]
    process = ManagedProcess(command, log_path=tmp_path / "engine.log", env=env, cwd=HERE)
    processes.append(process)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/health", timeout=60, proc=process)
    return process, url


FAKE_DRAIN = ["drain_engine.py", "--port", "{port}", "--token-delay-s", "0.1"]
VLLM_HTTP = ["vllm_http_engine.py", "{port}"]


def engines() -> list[Any]:
    vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM")
    return [
        pytest.param(FAKE_DRAIN, id="uvicorn"),
        pytest.param(VLLM_HTTP, id="vllm-launcher", marks=vllm),
    ]


@pytest.mark.parametrize("argv", engines())
def test_sigterm_drains_the_engine_then_it_exits(
    tmp_path: Path, processes: list[ManagedProcess], argv: list[str]
) -> None:
    process, url = start_drain_engine(tmp_path, processes, argv)
    first = threading.Event()
    body = {"model": "fake", "prompt": "drain me", "max_tokens": 20, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_lines, url, body, first)
        assert first.wait(30), "the stream never started"

        os.kill(process.pid, signal.SIGTERM)
        health = _until_not_200(f"{url}/health")
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        lines = stream.result(timeout=60)
    status = process.wait(60)

    assert health == 503
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    assert len(lines) == 21 and lines[-1] == "data: [DONE]"  # nothing cut
    assert status == 0
    record = json.loads((tmp_path / "engine.draining").read_text())
    assert record["pid"] == process.pid and record["timeout_s"] == 30


def test_drain_is_bounded_by_its_timeout(tmp_path: Path, processes: list[ManagedProcess]) -> None:
    process, url = start_drain_engine(tmp_path, processes, FAKE_DRAIN, drain_timeout_s=1)
    first = threading.Event()
    body = {"model": "fake", "prompt": "long", "max_tokens": 600, "stream": True}  # 60 s
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_lines_or_cut, url, body, first)
        assert first.wait(30), "the stream never started"
        started = time.monotonic()
        os.kill(process.pid, signal.SIGTERM)
        status = process.wait(30)
        waited = time.monotonic() - started
        lines = stream.result(timeout=30)

    assert waited >= 1.0  # it did wait for the stream, up to the timeout
    assert status == 0
    assert len(lines) < 601  # then it stopped without it
    assert "drain timeout" in process.log_path.read_text()


def test_a_second_sigterm_stops_without_waiting(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    process, url = start_drain_engine(tmp_path, processes, FAKE_DRAIN)
    first = threading.Event()
    body = {"model": "fake", "prompt": "long", "max_tokens": 600, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_lines_or_cut, url, body, first)
        assert first.wait(30), "the stream never started"
        os.kill(process.pid, signal.SIGTERM)
        assert _until_not_200(f"{url}/health") == 503
        os.kill(process.pid, signal.SIGTERM)
        process.wait(30)
        lines = stream.result(timeout=30)

    assert len(lines) < 601
    assert "second SIGTERM" in process.log_path.read_text()


def _until_not_200(url: str) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = httpx.get(url, timeout=5).status_code
        if status != 200:
            return status
        time.sleep(0.02)
    raise AssertionError(f"{url} kept answering 200")


def _lines_or_cut(url: str, body: dict[str, Any], first: threading.Event) -> list[str]:
    lines: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                first.set()
    except httpx.HTTPError:
        pass
    return [line for line in lines if line.startswith("data: ")]
