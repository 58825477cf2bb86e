"""The engines the proxy routes to, and their health.

An :class:`Engine` is what the proxy knows of an engine: a name, its base
URL, its fabric control endpoint, whether it answered its last health probe
and how many requests it is serving (for load-aware policies).

Health has two sources: a background probe of every engine's ``/health``
every ``health_interval_s`` (which also brings engines back), and failures
seen while serving requests (a refused connection marks the engine down at
once, so the next requests skip it instead of waiting on it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from fabric.config import EngineConfig, TopologyConfig
from fabric.errors import ConfigError

logger = logging.getLogger(__name__)


SLOW_PROBES_DOWN = 3
"""Timed-out health probes in a row that mark an engine down (refused: one)."""


@dataclass(eq=False)
class Engine:
    """One engine as the proxy sees it."""

    name: str
    role: str
    url: str
    kv_endpoint: str | None
    healthy: bool = True
    outstanding: int = 0
    last_error: str | None = field(default=None, repr=False)
    slow_probes: int = field(default=0, repr=False)

    def mark_down(self, reason: str) -> None:
        """Record a failure; logged once per transition."""
        if self.healthy:
            logger.warning("engine %s (%s) marked down: %s", self.name, self.url, reason)
        self.healthy = False
        self.last_error = reason

    def mark_up(self) -> None:
        """Record a successful probe; logged once per transition."""
        if not self.healthy:
            logger.warning("engine %s (%s) is back", self.name, self.url)
        self.healthy = True
        self.last_error = None
        self.slow_probes = 0


@dataclass
class EnginePool:
    """The prefillers and decoders of one proxy."""

    prefillers: list[Engine]
    decoders: list[Engine]

    @classmethod
    def from_topology(cls, topology: TopologyConfig) -> EnginePool:
        """Engines of a topology whose ports are known; decoders need a ``kv_port``."""
        prefillers = [_engine(f"prefill[{i}]", e) for i, e in enumerate(topology.prefill)]
        decoders = [_engine(f"decode[{i}]", e) for i, e in enumerate(topology.decode)]
        for i, engine in enumerate(decoders):
            if engine.kv_endpoint is None:
                raise ConfigError(
                    f"decode[{i}].kv_port: needed so prefillers know where to push KV "
                    f"(the kv_port of {engine.name}'s connector)"
                )
        return cls(prefillers, decoders)

    @property
    def engines(self) -> list[Engine]:
        """Every engine, prefillers first."""
        return [*self.prefillers, *self.decoders]

    def healthy_prefillers(self) -> list[Engine]:
        """Prefillers that answered their last probe (maybe none)."""
        return [e for e in self.prefillers if e.healthy]

    def candidate_decoders(self) -> list[Engine]:
        """Healthy decoders; all of them when none is healthy (one may be back)."""
        return [e for e in self.decoders if e.healthy] or self.decoders


FabricCheck = Callable[[Engine], Awaitable[str | None]]


async def probe(
    client: httpx.AsyncClient,
    engine: Engine,
    timeout_s: float,
    fabric_check: FabricCheck | None = None,
) -> bool:
    """GET the engine's ``/health``, then (``fabric_check``) ask its fabric
    side whether it can still serve KV; update and return its health."""
    try:
        response = await client.get(f"{engine.url}/health", timeout=timeout_s)
    except httpx.ConnectError as exc:  # refused: nothing listens there any more
        engine.mark_down(f"/health: {describe(exc)}")
        return False
    except httpx.HTTPError as exc:
        # NOTE: a busy engine on a loaded host can miss one probe's timeout;
        # only SLOW_PROBES_DOWN in a row take it out of rotation.
        engine.slow_probes += 1
        if engine.slow_probes >= SLOW_PROBES_DOWN:
            engine.mark_down(f"/health: {describe(exc)} ({engine.slow_probes} probes in a row)")
        return engine.healthy
    if response.status_code != 200:
        engine.mark_down(f"/health answered {response.status_code}")
        return False
    broken = await fabric_check(engine) if fabric_check is not None else None
    if broken:
        engine.mark_down(broken)
        return False
    engine.mark_up()
    return True


async def probe_all(
    client: httpx.AsyncClient,
    pool: EnginePool,
    timeout_s: float,
    fabric_check: FabricCheck | None = None,
) -> None:
    """Probe every engine concurrently."""
    await asyncio.gather(*(probe(client, e, timeout_s, fabric_check) for e in pool.engines))


async def health_loop(
    client: httpx.AsyncClient,
    pool: EnginePool,
    interval_s: float,
    timeout_s: float,
    fabric_check: FabricCheck | None = None,
) -> None:
    """Probe every engine every ``interval_s`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await probe_all(client, pool, timeout_s, fabric_check)


def describe(exc: BaseException) -> str:
    """A short description of an HTTP client error for logs and messages."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _engine(path: str, config: EngineConfig) -> Engine:
    try:
        url = config.base_url
    except ConfigError as exc:
        raise ConfigError(f"{path}.port: the proxy needs the engine's port or url") from exc
    return Engine(config.name, config.role, url, config.kv_endpoint)
