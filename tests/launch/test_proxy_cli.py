"""``fabric proxy CONFIG``: the proxy alone, for engines that already run."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from fabric.launch.process import free_port
from fabric.router.fake_engine import FakeEngineConfig
from tests.router.servers import FakeEngine


@pytest.fixture
def engines() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    p = FakeEngine(FakeEngineConfig(role="prefill")).start()
    d = FakeEngine(FakeEngineConfig(role="decode")).start()
    yield p, d
    p.stop()
    d.stop()


def test_proxy_serves_running_engines_until_sigterm(
    tmp_path: Path, engines: tuple[FakeEngine, FakeEngine]
) -> None:
    p, d = engines
    config = {"prefill": [{"url": p.url}], "decode": [{"url": d.url, "kv_port": free_port()}]}
    path = tmp_path / "running.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", "proxy", str(path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert line.strip() == f"fabric proxy: serving on http://127.0.0.1:{port}"
    assert response.status_code == 200
    assert len(p.seen) == 1 and len(d.seen) == 1
    assert status == 0


@pytest.mark.parametrize("command", ["proxy", "up"])
def test_config_error_is_one_message_and_status_2(tmp_path: Path, command: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "prefill: [{url: 'http://127.0.0.1:1'}]\n"
        "decode: [{url: 'http://127.0.0.1:2', kv_port: x}]\n"
    )

    result = subprocess.run(
        [sys.executable, "-m", "fabric.cli", command, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"fabric {command}: {path}: decode[0].kv_port: Input should be a valid integer"
    )


def test_proxy_needs_the_decoders_kv_port(tmp_path: Path) -> None:
    path = tmp_path / "nokv.yaml"
    path.write_text(
        "prefill: [{url: 'http://127.0.0.1:1'}]\ndecode: [{url: 'http://127.0.0.1:2'}]\n"
    )

    result = subprocess.run(
        [sys.executable, "-m", "fabric.cli", "proxy", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 2
    assert "decode[0].kv_port: needed so prefillers know where to push KV" in result.stderr
