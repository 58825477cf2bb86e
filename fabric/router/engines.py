"""The engines the proxy routes to, their health and their state.

An :class:`Engine` is what the proxy knows of an engine: a name, its base
URL, its fabric control endpoint, its state and how many requests it is
serving (for load-aware policies, and for draining).

States (:class:`EngineState`), from two separate flags: ``healthy`` (probes
and failures seen on requests) and ``draining`` (set by whoever runs the
engine, or seen: the engine refused a request with its drain 503)::

             set_draining(True)
        up  -------------------->  draining
        ^   <--------------------     |
        |    set_draining(False)      |  mark_down(reason), from up too
        |                             v
        +------ mark_up() ---------- down    (back to draining if it was draining)

- ``down``: not picked, its store not asked (its numbers are unknown);
  ``since`` says when it went down, ``last_error`` why. The health probe
  brings it back (``mark_up``) once it answers ``/health`` again; each such
  return starts a new ``epoch`` (its P->D canaries run again, see
  :mod:`fabric.router.ready`).
- ``draining``: policies never pick it; requests already on it continue.
  ``outstanding`` is exact (taken when a request or canary is routed to the
  engine, released however it ends), so ``await engine.wait_idle(timeout_s)``
  is a correct drain. An engine whose gate (:mod:`fabric.launch.drain`)
  answers a request or a health probe with its drain 503 is marked draining
  at once (:meth:`Engine.saw_draining`): no other request is sent there. That
  mark ends when a health probe passes again (``mark_up``: the engine was
  restarted, or its drain was called off) or with ``set_draining(False)``;
  a drain set by whoever runs the engine ends only with ``set_draining``.

Health has two sources: a background probe of every engine's ``/health``
every ``health_interval_s`` (which also brings engines back; a probe that
times out marks the engine down at once when a fresh TCP connection to it
cannot be made either: :func:`tcp_unreachable`), and failures
seen while serving requests (a refused connection marks the engine down at
once, so the next requests skip it instead of waiting on it).

An engine found unreachable (:meth:`Engine.mark_unreachable`: that probe,
or a request's connect that timed out when a fresh connect fails too,
:meth:`fabric.router.state.ProxyState.connect_failed`) also has every call
in flight to it cut (:mod:`fabric.router.calls`): a partition sends no FIN
nor RST, and their reads would wait for their timeouts. A refused
connection cuts nothing: the host answered, and a process that stopped
listening may still finish its streams (a graceful shutdown); one that died
reset them.

Everything here runs on the proxy's event loop (not thread-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from fabric.config import EngineConfig, TopologyConfig
from fabric.errors import ConfigError
from fabric.router.calls import EngineCalls

logger = logging.getLogger(__name__)


UNREACHABLE_CONNECT_S = 3.0
"""The least time a timed-out probe's fresh TCP connect gets before the engine is
unreachable (a SYN and its first two retransmissions)."""
SLOW_PROBES_DOWN = 3
"""Timed-out health probes in a row that mark a reachable engine down (refused or
unreachable: one, :func:`tcp_unreachable`)."""

API_KEY_ENV = "VLLM_API_KEY"
"""vLLM's environment variable for ``--api-key`` (``vllm/envs.py``)."""


class EngineState(enum.Enum):
    """What the proxy may do with an engine."""

    UP = "up"
    DRAINING = "draining"  # serves what it has, gets nothing new
    DOWN = "down"  # gets nothing


class Engine:
    """One engine as the proxy sees it."""

    def __init__(
        self,
        name: str,
        role: str,
        url: str,
        kv_endpoint: str | None,
        healthy: bool = True,
        outstanding: int = 0,
        api_key: str | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.url = url
        self.kv_endpoint = kv_endpoint
        self.api_key = api_key  # what the proxy's own calls (canaries) authenticate with
        self.healthy = healthy
        self.draining = False
        self.drain_seen = False  # draining because it refused a request so, not by set_draining
        self.last_error: str | None = None
        self.slow_probes = 0
        self.answered = False  # a health probe succeeded since it was last down
        self.epoch = 0  # +1 each time it comes back up
        self.since = time.time()  # wall clock of the last state change
        self._outstanding = outstanding
        self._idle: list[asyncio.Future[None]] = []
        self.early_tokens = 0  # a decoder: prompt tokens it holds early for this proxy (handoff)
        self.legs: set[asyncio.Task[None]] = set()  # a prefiller: its early handoffs' prefills
        self.kv_tokens: int | None = None  # a decoder: its KV cache in tokens (vLLM's /metrics)
        self.early_requests = 0  # a decoder: early handoffs it holds for this proxy
        self._kv_tokens_epoch = -1  # the epoch kv_tokens was read in
        self.calls = EngineCalls()  # calls in flight to it (prefills, decodes, streams)

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, {self.role!r}, {self.url!r}, {self.state.value})"

    @property
    def state(self) -> EngineState:
        if not self.healthy:
            return EngineState.DOWN
        return EngineState.DRAINING if self.draining else EngineState.UP

    @property
    def routable(self) -> bool:
        """Whether a policy may pick it: healthy and not draining."""
        return self.healthy and not self.draining

    @property
    def outstanding(self) -> int:
        """Requests (and canaries) on this engine now; exact."""
        return self._outstanding

    @outstanding.setter
    def outstanding(self, value: int) -> None:
        assert value >= 0, f"{self.name}: outstanding would be {value}"
        self._outstanding = value
        if value == 0 and self._idle:
            waiters, self._idle = self._idle, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until nothing is outstanding on it (True), or ``timeout_s`` passed (False)."""
        if self._outstanding == 0:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._idle.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return self._outstanding == 0
        finally:
            if waiter in self._idle:
                self._idle.remove(waiter)
        return True

    def mark_down(self, reason: str) -> None:
        """Record a failure; logged once per transition. A prefiller's early
        handoff legs are cancelled: their decoders are told at once and
        recompute (a stuck prefiller would hold their blocks)."""
        if self.healthy:
            logger.warning("engine %s (%s) marked down: %s", self.name, self.url, reason)
            self.since = time.time()
        self.healthy = False
        self.answered = False
        self.last_error = reason
        for leg in list(self.legs):
            leg.cancel()

    def mark_unreachable(self, reason: str) -> None:
        """:meth:`mark_down`, and end every call in flight to it now (with
        :class:`~fabric.router.calls.EngineUnreachable`)."""
        self.mark_down(reason)
        cut = self.calls.cut(reason)
        if cut:
            logger.warning("engine %s (%s): %d call(s) in flight cut", self.name, self.url, cut)

    def mark_up(self) -> None:
        """Record a successful probe; logged once per transition. Ends a drain
        that was only seen (:meth:`saw_draining`): the engine answers again."""
        if not self.healthy:
            logger.warning("engine %s (%s) is back", self.name, self.url)
            self.epoch += 1
            self.since = time.time()
        if self.drain_seen:
            self.set_draining(False)
        self.healthy = True
        self.answered = True
        self.last_error = None
        self.slow_probes = 0

    def set_draining(self, draining: bool) -> None:
        """Stop (True) or resume (False) routing new requests to it; logged on change."""
        self.drain_seen = False
        if draining != self.draining:
            logger.warning(
                "engine %s (%s) %s", self.name, self.url, "draining" if draining else "resumed"
            )
            self.draining = draining
            self.since = time.time()

    def saw_draining(self) -> None:
        """It answered with its drain 503: draining until a probe passes again."""
        if not self.draining:
            self.set_draining(True)
            self.drain_seen = True


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

    def find(self, name_or_url: str) -> Engine:
        """The engine named ``name_or_url`` (or with that base URL); LookupError if none."""
        for engine in self.engines:
            if name_or_url in (engine.name, engine.url, engine.url + "/"):
                return engine
        known = [e.name for e in self.engines]
        raise LookupError(f"no engine named {name_or_url!r} (nor with that URL); engines: {known}")

    def healthy_prefillers(self) -> list[Engine]:
        """Prefillers a policy may pick: healthy, not draining (maybe none)."""
        return [e for e in self.prefillers if e.routable]

    def candidate_decoders(self) -> list[Engine]:
        """Healthy decoders that are not draining; when none is healthy, every
        decoder that is not draining (one may be back); maybe none."""
        return [e for e in self.decoders if e.routable] or [
            e for e in self.decoders if not e.draining
        ]


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
        # only SLOW_PROBES_DOWN in a row take it out of rotation. One that
        # cannot be reached at all (a partition, a dead host: no TCP
        # connection within UNREACHABLE_CONNECT_S) is down at once.
        if isinstance(exc, httpx.TimeoutException):
            connect_s = max(timeout_s, UNREACHABLE_CONNECT_S)
            unreachable = await tcp_unreachable(engine.url, connect_s)
            if unreachable is not None:
                engine.mark_unreachable(f"/health: {describe(exc)}; {unreachable}")
                return False
        engine.slow_probes += 1
        if engine.slow_probes >= SLOW_PROBES_DOWN:
            engine.mark_down(f"/health: {describe(exc)} ({engine.slow_probes} probes in a row)")
        return engine.healthy
    if response.status_code != 200:
        if is_drain_refusal(response.status_code, response.content):
            engine.saw_draining()
        engine.mark_down(f"/health answered {response.status_code}")
        return False
    broken = await fabric_check(engine) if fabric_check is not None else None
    if broken:
        engine.mark_down(broken)
        return False
    engine.mark_up()
    if engine.role != "prefill" and engine._kv_tokens_epoch != engine.epoch:
        await read_kv_tokens(client, engine, timeout_s)
    return True


async def tcp_unreachable(url: str, timeout_s: float) -> str | None:
    """Why a fresh TCP connection to ``url``'s host and port cannot be made
    within ``timeout_s`` (None: it can; it is closed at once).

    The kernel completes the handshake for a listening socket while its
    accept queue has room, whatever the server process is doing, so this
    tells an engine that is slow to answer (connects) from one that cannot be
    reached (a partition, a dead host: the connect times out) or is gone
    (refused). A pooled keep-alive connection cannot tell: a request written
    on it during a partition only times out, like one to a busy engine. An
    engine whose accept queue stays full for the whole ``timeout_s`` (the
    kernel drops SYNs then) reads as unreachable too: the probe gives it
    ``UNREACHABLE_CONNECT_S`` at least (two SYN retransmissions).
    """
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    # NOTE: uvloop's loop (uvicorn's, so the proxy's) has no happy eyeballs:
    # the option is a TypeError there, and each address is tried in turn.
    uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    try:
        connecting = (
            asyncio.open_connection(host, port)
            if uvloop
            else asyncio.open_connection(host, port, happy_eyeballs_delay=0.25)
        )
        _, writer = await asyncio.wait_for(connecting, timeout_s)
    except TimeoutError:
        return f"no TCP connection to {host}:{port} within {timeout_s:g} s (unreachable)"
    except OSError as exc:
        return f"TCP connect to {host}:{port} failed: {exc}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


KV_TOKENS = re.compile(r'^vllm:cache_config_info\{[^}]*kv_cache_size_tokens="(\d+)"', re.M)


async def read_kv_tokens(client: httpx.AsyncClient, engine: Engine, timeout_s: float) -> None:
    """A decoder's KV cache size in tokens, once per time it comes up (vLLM
    exports it as ``vllm:cache_config_info{kv_cache_size_tokens=...}``); the
    early handoff's default budget. Left unknown when it cannot be read."""
    try:
        response = await client.get(f"{engine.url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return
    match = KV_TOKENS.search(response.text) if response.status_code == 200 else None
    engine._kv_tokens_epoch = engine.epoch
    engine.kv_tokens = int(match.group(1)) if match else None


async def probe_all(
    client: httpx.AsyncClient,
    pool: EnginePool,
    timeout_s: float,
    fabric_check: FabricCheck | None = None,
) -> None:
    """Probe every engine concurrently."""
    await asyncio.gather(*(probe(client, e, timeout_s, fabric_check) for e in pool.engines))


def is_drain_refusal(status: int, payload: bytes) -> bool:
    """Whether an answer is a drain gate's refusal (:class:`fabric.launch.drain.DrainGate`:
    503, ``{"error": {"type": "service_unavailable", "message": "... is draining ..."}}``).

    NOTE: the gate answers before the app reads the request, so nothing of it ran.
    """
    if status != 503 or len(payload) > 4096:
        return False
    try:
        error = json.loads(payload)["error"]
        return error["type"] == "service_unavailable" and " is draining" in error["message"]
    except (ValueError, LookupError, TypeError):
        return False


def api_key(config: EngineConfig) -> str | None:
    """The API key an engine checks, where the topology says: its ``args``'
    ``--api-key`` (the first key), else ``VLLM_API_KEY`` in its ``env``, else
    in the proxy's environment (which the engines ``fabric up`` starts inherit)."""
    args = config.args
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--api-key="):
            return arg.partition("=")[2]
    return config.env.get(API_KEY_ENV) or os.environ.get(API_KEY_ENV) or None


def describe(exc: BaseException) -> str:
    """A short description of an HTTP client error for logs and messages."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _engine(path: str, config: EngineConfig) -> Engine:
    try:
        url = config.base_url
    except ConfigError as exc:
        raise ConfigError(f"{path}.port: the proxy needs the engine's port or url") from exc
    return Engine(config.name, config.role, url, config.kv_endpoint, api_key=api_key(config))
