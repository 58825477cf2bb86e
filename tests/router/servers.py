"""In-process servers for the proxy tests: fake engines and proxies on free ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from fabric.config import TopologyConfig, parse_topology
from fabric.launch.drain import EngineDrain
from fabric.launch.process import free_port
from fabric.router import create_app
from fabric.router.serve import bind_socket, socket_url
from fabric.router.state import ProxyState
from fabric.testing.fake_engine import FakeEngineConfig, FakeEngineState, create_fake_engine
from tests.netns import Hosts

T = TypeVar("T")
ROOT = Path(__file__).parent.parent.parent


class ServerThread:
    """An ASGI app served by uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._sock = bind_socket("127.0.0.1", 0)
        self.url = socket_url(self._sock)
        config = uvicorn.Config(
            app, access_log=False, log_config=None, lifespan="on", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout: float = 10.0) -> Self:
        """Start serving; return once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop_listening(self) -> None:
        """Close the listening socket: fresh connections are refused, open ones
        go on (a process on its way out). Call it on the server's loop (from
        a request's handler)."""
        for server in self._server.servers:
            server.close()

    def request_stop(self) -> None:
        """Ask the server to shut down (returns at once)."""
        self._server.should_exit = True

    def stop(self) -> None:
        """Shut down and join the thread."""
        self.request_stop()
        self._thread.join(10.0)
        self._sock.close()


class FakeEngine(ServerThread):
    """A fake engine in a thread; ``seen`` holds the requests it received.

    ``gated``: behind the drain gate engines run (``fabric.launch.drain``);
    ``gate.draining = True`` makes it refuse new work as a draining engine.
    """

    def __init__(self, config: FakeEngineConfig, *, gated: bool = False) -> None:
        self.fake_app = create_fake_engine(config)
        self.gate = EngineDrain(self.fake_app, timeout_s=30.0, drain_file=None)
        super().__init__(self.gate if gated else self.fake_app)
        self.config = config

    @property
    def state(self) -> FakeEngineState:
        """The engine's recorded state."""
        state: FakeEngineState = self.fake_app.state.fake
        return state

    @property
    def seen(self) -> list[dict[str, Any]]:
        """Generation requests received so far, oldest first."""
        return list(self.state.seen)


class Proxy(ServerThread):
    """A proxy in a thread."""

    app: FastAPI

    def __init__(self, topology: TopologyConfig) -> None:
        super().__init__(create_app(topology))

    @property
    def state(self) -> ProxyState:
        """The proxy's state (counters, engines)."""
        state: ProxyState = self.app.state.proxy
        return state

    def run(self, call: Callable[[ProxyState], Awaitable[T]], timeout: float = 60.0) -> T:
        """``await call(state)`` on the proxy's event loop (its control API); the result."""
        loop = self.state.loop
        assert loop is not None, "the proxy is not running"

        async def go() -> T:
            return await call(self.state)

        return asyncio.run_coroutine_threadsafe(go(), loop).result(timeout)


def dead_url() -> str:
    """The URL of a loopback port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def full_accept_queue() -> Iterator[str]:
    """A loopback listener whose accept queue is full: the kernel drops new
    SYNs, so a connect to it times out as one across a partition does; its URL."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with contextlib.ExitStack() as stack:
            for _ in range(3):
                filler = stack.enter_context(socket.socket())
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
            time.sleep(0.05)  # NOTE: the handshakes that fit are done
            yield f"http://127.0.0.1:{port}"


def topology(
    prefill_urls: list[str],
    decode_urls: list[str],
    kv_ports: list[int] | None = None,
    **proxy: Any,
) -> tuple[TopologyConfig, list[int]]:
    """A topology of running engines; returns it and the decoders' kv ports.

    NOTE: ``handoff: sequential`` unless a test asks otherwise: most fake
    decoders serve no kv port (the early handoff's tests start ones that do).
    """
    kv_ports = kv_ports or [free_port() for _ in decode_urls]
    proxy_config = {"port": None, "health_interval_s": 0, "handoff": "sequential", **proxy}
    data = {
        "prefill": [{"url": url} for url in prefill_urls],
        "decode": [
            {"url": url, "kv_port": kv} for url, kv in zip(decode_urls, kv_ports, strict=True)
        ],
        "proxy": proxy_config,
    }
    return parse_topology(data, source="test"), kv_ports


@contextlib.contextmanager
def child(argv: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """``argv`` as a child process in the repository root (``popen``: its pipes,
    text), stopped by pid on exit: SIGTERM, SIGKILL after 30 s."""
    process = subprocess.Popen(argv, cwd=ROOT, text=True, **popen)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def fake_engine_on(hosts: Hosts, host: str, port: int, *options: str) -> Iterator[str]:
    """A fake engine (``python -m fabric.testing.fake_engine``, ``options``) in
    ``host``'s namespace (:mod:`tests.netns`), stopped on exit; its URL."""
    address = hosts.address(host)
    argv = [sys.executable, "-m", "fabric.testing.fake_engine", "--host", address]
    with child(hosts.command(host, [*argv, "--port", str(port), *options]), env=dict(os.environ)):
        yield f"http://{address}:{port}"
