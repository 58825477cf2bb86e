"""Serving the proxy app: socket, uvicorn, signals.

Used by ``fabric proxy`` and ``fabric up``. The listening socket is bound
before anything else starts (a taken port fails fast, port 0 picks a free
one), and uvicorn runs without an access log (~14% of the per-request cost
at one client), on uvloop and httptools when installed
(uvicorn's ``auto`` choices).

Signals: uvicorn traps SIGINT/SIGTERM while it serves, shuts down, then
re-raises the signal with the previous handlers restored. Under
:func:`shutdown_on_signals` that previous handler raises :class:`Shutdown`,
so the caller's ``finally`` blocks (which stop the engines) always run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Coroutine, Iterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from fabric.config import TopologyConfig
from fabric.router.admin import check_admin_exposure
from fabric.router.app import create_app

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

CLIENT_KEEPALIVE_S = 75.0
"""How long the proxy keeps a client's idle connection open by default
(``proxy.client_keepalive_s``). Above what
clients keep theirs (httpx and the OpenAI SDK: 5 s, aiohttp: 15 s): with the
server's close at the same 5 s as the client's expiry (uvicorn's default),
a request sent on a connection the client still holds can meet the close
and read a reset, an error without an answer."""


def uvicorn_config(
    app: Any, keepalive_s: float = CLIENT_KEEPALIVE_S, **extra: Any
) -> uvicorn.Config:
    """The proxy's uvicorn settings: no access log (~14% of the per-request
    cost at one client), no X-Forwarded-* rewriting (the proxy never reads
    the client's address), no Server header, a client's idle connection kept
    ``keepalive_s`` (whole seconds: uvicorn's unit); ``extra`` adds to them."""
    return uvicorn.Config(
        app,
        access_log=False,
        log_config=None,
        lifespan="on",
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=max(1, round(keepalive_s)),
        **extra,
    )


class Shutdown(Exception):
    """SIGINT or SIGTERM asked the process to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def shutdown_on_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise :class:`Shutdown`."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Shutdown(signum)

    previous = {sig: signal.signal(sig, handler) for sig in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Within the block (cleanup), SIGINT and SIGTERM are ignored."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def bind_socket(host: str, port: int | None) -> socket.socket:
    """A TCP socket bound to ``host:port`` (None or 0: a free port), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port or 0))
    except OSError:
        sock.close()
        raise
    return sock


def socket_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve_app(
    app: FastAPI,
    sock: socket.socket,
    on_started: Callable[[str], None],
    keepalive_s: float = CLIENT_KEEPALIVE_S,
) -> None:
    """Serve ``app`` on ``sock`` until a signal; call ``on_started(url)`` once it accepts."""
    server = uvicorn.Server(uvicorn_config(app, keepalive_s))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        on_started(socket_url(sock))
    await task


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on a new event loop: uvloop when installed, as uvicorn would."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def run_proxy(
    topology: TopologyConfig,
    *,
    host: str | None = None,
    port: int | None = None,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve the proxy of ``topology`` until SIGINT/SIGTERM (``fabric proxy``)."""
    say = announce or (lambda message: print(message, flush=True))
    bind = host or topology.proxy_bind
    check_admin_exposure(topology, bind)
    app = create_app(topology)
    sock = bind_socket(bind, port if port is not None else topology.proxy.port)
    with sock, shutdown_on_signals(), contextlib.suppress(Shutdown):
        keepalive_s = topology.proxy.client_keepalive_s
        run_loop(
            serve_app(app, sock, lambda url: say(f"fabric proxy: serving on {url}"), keepalive_s)
        )
