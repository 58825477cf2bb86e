"""``fabric proxy CONFIG``: the proxy alone, for engines that already run."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from fabric.config import parse_topology
from fabric.errors import ConfigError
from fabric.launch.process import free_port
from fabric.testing.fake_engine import FakeEngineConfig
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
    proc, port = _start_proxy(tmp_path, p, d)
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


def test_an_idle_client_connection_is_kept_past_a_clients_5_s_expiry(
    tmp_path: Path, engines: tuple[FakeEngine, FakeEngine]
) -> None:
    """A client that reuses a connection idle for almost its keep-alive
    expiry (httpx: 5 s) must not find it closed under its request: with the
    server's own 5 s (uvicorn's default) the close races the request and the
    client reads a reset (seen in a soak as a request without an answer)."""
    with (
        _running_proxy(tmp_path, *engines) as port,
        socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
    ):
        sock.sendall(REQUEST)
        first = _read_answer(sock)
        time.sleep(6.0)  # NOTE: past uvicorn's default 5 s, within httpx's expiry + 1 s
        sock.sendall(REQUEST)
        second = _read_answer(sock)

    assert first.startswith(b"HTTP/1.1 200")
    assert second.startswith(b"HTTP/1.1 200"), second


REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\nConnection: keep-alive\r\n\r\n"


@contextlib.contextmanager
def _running_proxy(
    tmp_path: Path, p: FakeEngine, d: FakeEngine, proxy: dict[str, object] | None = None
) -> Iterator[int]:
    """``fabric proxy`` serving (its port) until the block ends, then stopped."""
    proc, port = _start_proxy(tmp_path, p, d, proxy)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_answer(sock: socket.socket) -> bytes:
    """One HTTP/1.1 answer with a Content-Length (b"" when the peer closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            return data
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        more = sock.recv(65536)
        if not more:
            break  # NOTE: closed mid-body: the caller sees a short answer
        body += more
    return head + b"\r\n\r\n" + body


def test_fabric_ups_proxy_keeps_client_connections_as_long_as_fabric_proxy() -> None:
    from fabric.launch.proxy_server import _config
    from fabric.router.serve import CLIENT_KEEPALIVE_S

    config = _config(lambda scope, receive, send: None, CLIENT_KEEPALIVE_S)  # type: ignore[arg-type]
    assert config.timeout_keep_alive == CLIENT_KEEPALIVE_S > 15
    topology = {"prefill": [{"url": "http://p"}], "decode": [{"url": "http://d"}]}
    assert parse_topology(topology).proxy.client_keepalive_s == CLIENT_KEEPALIVE_S
    with pytest.raises(ConfigError, match=r"proxy\.client_keepalive_s"):
        parse_topology(topology | {"proxy": {"client_keepalive_s": 0.5}})


def test_proxy_client_keepalive_s_sets_how_long_an_idle_connection_stays(
    tmp_path: Path, engines: tuple[FakeEngine, FakeEngine]
) -> None:
    """``proxy.client_keepalive_s: 1``: an idle client connection is closed
    after about a second (the default keeps it 75 s, test above)."""
    with (
        _running_proxy(tmp_path, *engines, proxy={"client_keepalive_s": 1}) as port,
        socket.create_connection(("127.0.0.1", port), timeout=30) as sock,
    ):
        sock.sendall(REQUEST)
        first = _read_answer(sock)
        closed = sock.recv(65536)  # NOTE: blocks until the proxy closes it

    assert first.startswith(b"HTTP/1.1 200")
    assert closed == b""


def _start_proxy(
    tmp_path: Path, p: FakeEngine, d: FakeEngine, proxy: dict[str, object] | None = None
) -> tuple[subprocess.Popen[str], int]:
    """``fabric proxy`` in front of ``p`` and ``d`` on a free port (stdout
    piped); ``proxy``: the topology's proxy section."""
    config: dict[str, object] = {
        "prefill": [{"url": p.url}],
        "decode": [{"url": d.url, "kv_port": free_port()}],
    }
    if proxy:
        config["proxy"] = proxy
    path = tmp_path / "running.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", "proxy", str(path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return proc, port
