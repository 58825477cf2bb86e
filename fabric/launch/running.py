"""What ``fabric up`` runs while it serves: the proxy behind its drain gate,
the supervisor of its processes, and ``WORKDIR/run/up.json``.

The proxy and the supervisor share one event loop (the supervisor changes
the proxy's engine objects directly). ``up.json`` is rewritten atomically
on every change the supervisor sees, and when a drain starts; its fields
are listed in :mod:`fabric.launch.up`.

Readiness of a restarted process (:func:`_readiness`): the store once its
endpoint file is back; an engine once the proxy's health probe marked it up
-- or, with the proxy's probe off (``health_interval_s: 0``), once its
``/health`` answers, and the supervisor then marks it up itself (unless
the process it asked exited meanwhile). The supervisor probes every child
at once (:class:`~fabric.launch.supervisor.Supervisor`), so each round of
probes takes at most one ``PROBE_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from fabric.config import EngineConfig, TopologyConfig
from fabric.errors import LaunchError
from fabric.launch.drain import DEFAULT_DRAIN_TIMEOUT_S, DrainGate
from fabric.launch.supervisor import Child, ChildState, Supervisor

if TYPE_CHECKING:
    from fabric.launch.process import ManagedProcess
    from fabric.router.engines import Engine
    from fabric.router.state import ProxyState

Announce = Callable[[str], None]
PROBE_TIMEOUT_S = 2.0
READY_TIMEOUT_S = 60.0


@dataclass
class EngineRun:
    """An engine of the running topology; ``child`` is None for a ``url`` engine."""

    config: EngineConfig
    child: Child | None = None

    @property
    def name(self) -> str:
        """The engine's name."""
        return self.config.name

    @property
    def process(self) -> ManagedProcess | None:
        """Its current process (None: a ``url`` engine, or exited and not restarted yet)."""
        return self.child.process if self.child is not None else None


@dataclass
class Running:
    """What ``fabric up`` runs while it serves, and where it records it."""

    runs: Sequence[EngineRun]
    store: Child | None
    state_path: Path
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    proxy_url: str | None = None
    draining: bool = False
    host: str | None = None  # this machine's name in a topology across hosts
    proxy_here: bool = True  # the proxy runs in this process (else on another host)

    @property
    def children(self) -> list[Child]:
        """Every supervised process: the store first, then the launched engines."""
        engines = [run.child for run in self.runs if run.child is not None]
        return [self.store, *engines] if self.store is not None else engines

    def write_state(self) -> None:
        """(Re)write ``up.json`` atomically (once the proxy serves, where it runs here)."""
        if self.proxy_url is None and self.proxy_here:
            return
        state = {
            "proxy_url": self.proxy_url,
            "host": self.host,
            "state": "draining" if self.draining else "serving",
            "drain_timeout_s": self.drain_timeout_s,
            "engines": [_engine_state(run) for run in self.runs],
            "store": self.store.as_dict() if self.store is not None else None,
        }
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_path)


def _engine_state(run: EngineRun) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": run.name,
        "role": run.config.role,
        "url": run.config.base_url,
        "kv_endpoint": run.config.kv_endpoint,
    }
    if run.child is None:
        return entry | {"pid": None, "log": None, "state": None, "restarts": 0}
    return entry | run.child.as_dict()


def serve_proxy(
    topology: TopologyConfig, sock: socket.socket, running: Running, announce: Announce
) -> None:
    """Serve the proxy of ``topology`` on ``sock`` behind its drain gate, and
    supervise ``running``, until a stop signal and its drain are over."""
    from fabric.router import create_app
    from fabric.router.serve import run_loop

    app = create_app(topology)
    proxy: ProxyState = app.state.proxy
    for run in running.runs:
        if run.child is not None:
            run.child.engine = _find_engine(proxy, run.name)
    run_loop(_serve(DrainGate(app, name="the proxy"), proxy, sock, running, announce))


async def _serve(
    gate: DrainGate, proxy: ProxyState, sock: socket.socket, running: Running, announce: Announce
) -> None:
    from fabric.launch.proxy_server import Hooks, serve_drained

    self_probe = proxy.config.health_interval_s <= 0
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
        ready = _readiness(client, self_probe, probe_one=proxy.probe_engine)
        supervisor = Supervisor(running.children, ready, running.write_state)

        async def started(url: str) -> None:
            running.proxy_url = url
            running.write_state()
            announce(
                f"fabric up: proxy serving at {url} (Ctrl-C stops everything); ready once "
                "every P->D pair passed a canary transfer"
            )
            await _wait_ready(proxy, url, announce)

        def draining(in_flight: int) -> None:
            running.draining = True
            running.write_state()
            announce(
                f"fabric up: draining: {in_flight} requests in flight "
                f"(at most {running.drain_timeout_s:.0f} s; new requests get 503)"
            )

        def drained(done: bool, in_flight: int) -> None:
            supervisor_task.cancel()
            if done:
                announce("fabric up: drained")
            else:
                announce(f"fabric up: drain timeout: {in_flight} requests still running are cut")

        supervisor_task = asyncio.create_task(supervisor.run(), name="fabric-up-supervisor")
        hooks = Hooks(started, draining, drained, supervisor.restart_stopped)
        try:
            keepalive_s = proxy.config.client_keepalive_s
            await serve_drained(gate, sock, running.drain_timeout_s, hooks, keepalive_s)
        finally:
            supervisor_task.cancel()


def serve_engines(running: Running, announce: Announce) -> None:
    """Supervise ``running``'s engines (and store) until a stop signal, where the
    proxy runs on another host (``fabric up --host``): each child is probed on
    its own ``/health``; SIGUSR1 restarts those drained on purpose."""
    from fabric.router.engines import Engine
    from fabric.router.serve import run_loop

    for run in running.runs:
        if run.child is not None:
            config = run.config
            run.child.engine = Engine(config.name, config.role, config.base_url, None)
    run_loop(_supervise(running, announce))


async def _supervise(running: Running, announce: Announce) -> None:
    from fabric.launch.proxy_server import STOP_SIGNALS, TICK_S, Signals

    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
        supervisor = Supervisor(running.children, _readiness(client, True), running.write_state)
        with Signals().installed() as signals:
            task = asyncio.create_task(supervisor.run(), name="fabric-up-supervisor")
            running.write_state()
            where = running.proxy_url or "its host"
            announce(f"fabric up: {running.host}: serving (the proxy: {where}; Ctrl-C stops)")
            try:
                while not task.done():
                    taken = signals.take()
                    if any(signum in STOP_SIGNALS for signum in taken):
                        running.draining = True
                        running.write_state()
                        return
                    if taken:
                        supervisor.restart_stopped()
                    await asyncio.sleep(TICK_S)
                task.result()  # NOTE: the supervisor never ends by itself; if it raised, say so
            finally:
                task.cancel()


def _readiness(
    client: httpx.AsyncClient,
    self_probe: bool,
    probe_one: Callable[[Engine], Awaitable[bool]] | None = None,
) -> Callable[[Child], Any]:
    """Whether a live child serves (see the module docstring).

    ``self_probe``: no proxy probes the engines here, so this asks each one
    that is not healthy for its ``/health``. Otherwise a (re)started engine
    (``starting``) is probed at every supervisor tick with ``probe_one`` (the
    proxy's own probe: ``/health`` and the engine's fabric side), not only at
    the proxy's next health round (``health_interval_s``, 5 s by default):
    a restart serves as soon as it answers."""

    async def ready(child: Child) -> bool:
        if child.ready_file is not None:
            return child.ready_file.exists()
        engine = child.engine
        if engine is None:
            return True
        if engine.healthy:
            return True
        process = child.process
        if self_probe:
            try:
                response = await client.get(f"{engine.url}/health")
            except httpx.HTTPError:
                return False
            # NOTE: an answer of a process that exited since must not mark its
            # successor (or nothing) up: the supervisor marked it down at the exit.
            if response.status_code == 200 and child.process is process and child.alive():
                engine.mark_up()
        elif probe_one is not None and child.state is ChildState.STARTING:
            answered = await probe_one(engine)
            if answered and not (child.process is process and child.alive()):
                engine.mark_down("process exited")  # NOTE: as above: not its successor
        return bool(engine.healthy)

    return ready


async def _wait_ready(proxy: ProxyState, url: str, announce: Announce) -> None:
    """Report the proxy's readiness check (a canary transfer per P->D pair, see
    :mod:`fabric.router.ready`); the proxy serves meanwhile."""
    try:
        missing = await proxy.wait_ready(READY_TIMEOUT_S)
    except Exception as exc:
        announce(f"fabric up: warning: the proxy's ready check failed: {exc}")
        return
    if missing:
        announce(
            f"fabric up: warning: not ready after {READY_TIMEOUT_S:.0f} s (requests are "
            f"served meanwhile): {'; '.join(map(str, missing))}"
        )
    else:
        announce(f"fabric up: proxy ready at {url}: every P->D pair passed its canary transfer")


def _find_engine(proxy: ProxyState, name: str) -> Any:
    for engine in proxy.pool.engines:
        if engine.name == name:
            return engine
    raise LaunchError(f"{name}: the proxy has no engine of that name")
