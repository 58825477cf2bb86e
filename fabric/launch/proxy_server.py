"""The proxy under ``fabric up``: served until SIGTERM/SIGINT/SIGHUP, then drained.

::

    SIGTERM/SIGINT/SIGHUP -> the DrainGate closes: new requests get 503 JSON
                      (Connection: close), GET /health 503; requests in flight
                      continue -- at most drain_timeout_s
                   -> uvicorn stops: listener closed, idle connections closed;
                      what still runs after the drain timeout is cancelled
                      after GRACE_S more
    a second SIGTERM/SIGINT/SIGHUP -> stop without waiting
    SIGUSR1 -> on_usr1() (fabric up: restart engines drained on purpose)

SIGHUP stops like SIGTERM: a hangup (the terminal or SSH session of
``fabric up`` closed) would otherwise end the process without its cleanup,
and the engines, each in a session of its own, would run on.

If uvicorn or the app's lifespan startup fails, or the server stops by
itself, :func:`serve_drained` raises ``LaunchError``, so ``fabric up``
stops everything and exits 1. uvicorn logs the error, then either calls
``sys.exit`` from its startup (a failed lifespan startup sets
``should_exit``, ``uvicorn/lifespan/on.py:59-60``, and ``startup`` exits 3,
``uvicorn/server.py:116-118``) -- a ``SystemExit`` that would leave the
event loop past this module -- or returns without having started
(``server.py:105-107``).

Unlike ``fabric.router.serve.serve_app``, uvicorn's own signal handlers are
off (it would close the listener at once, so new requests would be refused
connections rather than answered 503): this module's handlers only record
the signal, and :func:`serve_drained` acts on it from the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn

from fabric.errors import LaunchError
from fabric.launch.drain import DrainGate
from fabric.router.serve import CLIENT_KEEPALIVE_S, socket_url, uvicorn_config

TICK_S = 0.05
GRACE_S = 2  # uvicorn takes whole seconds
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class QuietServer(uvicorn.Server):
    """uvicorn without its SIGINT/SIGTERM handlers (ours decide when it stops)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Signals:
    """Signals received while serving, in order (the handlers only append)."""

    received: list[int] = field(default_factory=list)
    seen: int = 0

    def take(self) -> list[int]:
        """The signals received since the last call."""
        new = self.received[self.seen :]
        self.seen = len(self.received)
        return new

    @contextlib.contextmanager
    def installed(self) -> Iterator[Signals]:
        """Within the block, the stop signals and SIGUSR1 are recorded here."""

        def handler(signum: int, frame: FrameType | None) -> None:
            self.received.append(signum)

        handled = (*STOP_SIGNALS, signal.SIGUSR1)
        previous = {sig: signal.signal(sig, handler) for sig in handled}
        try:
            yield self
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


@dataclass(frozen=True)
class Hooks:
    """What ``serve_drained`` tells its caller."""

    started: Callable[[str], Coroutine[Any, Any, None]]  # the proxy's URL, once it accepts
    draining: Callable[[int], None] = lambda in_flight: None
    drained: Callable[[bool, int], None] = lambda drained, in_flight: None
    usr1: Callable[[], None] = lambda: None


async def serve_drained(
    gate: DrainGate,
    sock: socket.socket,
    drain_timeout_s: float,
    hooks: Hooks,
    keepalive_s: float = CLIENT_KEEPALIVE_S,
) -> None:
    """Serve ``gate`` (the proxy app behind its drain gate) on ``sock`` until a
    stop signal, then drain it (see the module docstring).

    Raises ``LaunchError`` when the server does not start, or stops by itself.
    """
    server = QuietServer(_config(gate, keepalive_s))
    with Signals().installed() as signals:
        task = asyncio.create_task(_serve(server, sock))
        while not server.started and not task.done():
            await asyncio.sleep(TICK_S)
        if not server.started:
            raise _failed(task, "did not start")
        # NOTE: its own task: a stop signal is acted on while it still runs.
        started = asyncio.create_task(hooks.started(socket_url(sock)))
        try:
            stopped = await _until_stop(signals, task, hooks)
            if stopped:
                await _drain(gate, signals, drain_timeout_s, hooks)
        finally:
            if not started.done():
                started.cancel()
            server.should_exit = True
            await asyncio.wait({task})
    if not stopped:
        raise _failed(task, "stopped by itself")
    task.result()  # NOTE: an error of its own shutdown is not swallowed


async def _serve(server: QuietServer, sock: socket.socket) -> None:
    """``server.serve``, its ``sys.exit`` at a failed startup a ``LaunchError``."""
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:
        raise LaunchError(
            f"proxy: the server did not start (uvicorn exited with status {exc.code}: "
            "its lifespan startup failed or it could not serve; see the error logged above)"
        ) from None


def _failed(task: asyncio.Task[None], what: str) -> LaunchError:
    """The error of a server task that ended (its exception, if it raised one)."""
    error = None if task.cancelled() else task.exception()
    if isinstance(error, LaunchError):
        return error
    if error is not None:
        return LaunchError(f"proxy: the server {what}: {error!r}")
    return LaunchError(
        f"proxy: the server {what} (its lifespan startup failed or uvicorn could not "
        "serve: see the error logged above)"
    )


async def _until_stop(signals: Signals, task: asyncio.Task[None], hooks: Hooks) -> bool:
    """Wait for a stop signal (True), or for the server to end by itself (False)."""
    while not task.done():
        for signum in signals.take():
            if signum in STOP_SIGNALS:
                return True
            hooks.usr1()
        await asyncio.sleep(TICK_S)
    return False


async def _drain(gate: DrainGate, signals: Signals, timeout_s: float, hooks: Hooks) -> None:
    gate.draining = True
    hooks.draining(gate.in_flight)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while gate.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
        if any(signum in STOP_SIGNALS for signum in signals.take()):
            break  # a second stop signal: no more waiting
        await asyncio.sleep(TICK_S)
    hooks.drained(gate.in_flight == 0, gate.in_flight)


def _config(app: DrainGate, keepalive_s: float) -> uvicorn.Config:
    # NOTE: fabric proxy's settings, plus a bound on the wait for
    # connections still open once the drain is over.
    return uvicorn_config(app, keepalive_s, timeout_graceful_shutdown=GRACE_S)
