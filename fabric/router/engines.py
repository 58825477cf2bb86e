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
cannot be made either: :func:`tcp_connect_failure`), and failures
seen while serving requests (a refused connection marks the engine down at
once, so the next requests skip it instead of waiting on it).

An engine found unreachable (:meth:`Engine.mark_unreachable`: that probe,
or a request's connect that timed out, when the fresh connect times out
or finds no route too, :meth:`fabric.router.state.ProxyState.connect_failed`)
also has every call in flight to it cut (:mod:`fabric.router.calls`): a
partition sends no FIN nor RST, and their reads would wait for their
timeouts. A refused connection cuts nothing, even after a probe or a
connect that timed out (the engine is down, as before): the host answered,
and a process that stopped listening (restarting, a graceful shutdown; a
Kubernetes Service without ready endpoints refuses too) may still finish
the streams on its open connections; one that died reset them.

Everything here runs on the proxy's event loop (not thread-safe).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import ipaddress
import json
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from fabric.config import EngineConfig, TopologyConfig
from fabric.errors import ConfigError
from fabric.router.calls import EngineCalls

logger = logging.getLogger(__name__)


UNREACHABLE_CONNECT_S = 3.0
"""The least time a timed-out probe's fresh TCP connect gets before the engine is
unreachable (a SYN and its first two retransmissions)."""
STALL_GRACE_S = 0.05
"""A connect check's last look, past its bound, for a connect that completed
while the loop was stalled."""
SLOW_PROBES_DOWN = 3
"""Timed-out health probes in a row that mark a reachable engine down (refused or
unreachable: one, :func:`tcp_connect_failure`)."""

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
        """End every call in flight to it now (with
        :class:`~fabric.router.calls.EngineUnreachable`), and :meth:`mark_down`.

        NOTE: the cut first: a prefill leg in flight is cut (counted once),
        then cancelled by ``mark_down`` as any leg; cut after that cancel it
        would not count (see :meth:`fabric.router.calls.Call.cut`).
        """
        cut = self.calls.cut(reason)
        self.mark_down(reason)
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
        # connection within UNREACHABLE_CONNECT_S) is down at once, and so is
        # one that refuses the fresh connection (its calls are not cut).
        if isinstance(exc, httpx.TimeoutException):
            connect_s = max(timeout_s, UNREACHABLE_CONNECT_S)
            failure = await tcp_connect_failure(engine.url, connect_s)
            if failure is not None:
                why = f"/health: {describe(exc)}; {failure.reason}"
                if failure.unreachable:
                    engine.mark_unreachable(why)
                else:  # NOTE: refused: down, as a refused probe; its calls go on
                    engine.mark_down(why)
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


UNREACHABLE_ERRNOS = frozenset(
    {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN, errno.ETIMEDOUT}
)
"""Connect errors that say no route leads to the engine's host (a router's
ICMP unreachable, no route here) or that the kernel gave up on it (its own
connect timeout): unreachable, as a connect that times out. Not a refusal
(ECONNREFUSED: something answered), nor a local error."""


@dataclass(frozen=True)
class ConnectFailure:
    """Why a fresh TCP connection to an engine could not be made (:func:`tcp_connect_failure`)."""

    reason: str
    unreachable: bool
    """Every address of the engine timed out or had no route (a partition, a
    dead host): its calls in flight are cut. False: one refused (nothing
    listens: a process restarting, a Kubernetes Service without ready
    endpoints) or another error (its name is not resolved): something
    answered, and the streams on connections made before may go on."""


def _literal(host: str, port: int) -> list[tuple[Any, ...]]:
    """``getaddrinfo``'s answer for an IP address ``host``; [] for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return []
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    return [(family, socket.SOCK_STREAM, 0, "", (host, port))]


async def tcp_connect_failure(url: str, timeout_s: float) -> ConnectFailure | None:
    """Why a fresh TCP connection to ``url``'s host and port cannot be made
    within ``timeout_s`` (None: it can; it is closed at once).

    The kernel completes the handshake for a listening socket while its
    accept queue has room, whatever the server process is doing, so this
    tells an engine that is slow to answer (connects) from one that cannot be
    reached (a partition, a dead host: the connect times out, or finds no
    route) or is not listening (refused). A pooled keep-alive connection
    cannot tell: a request written on it during a partition only times out,
    like one to a busy engine. An engine whose accept queue stays full for
    the whole ``timeout_s`` (the kernel drops SYNs then) reads as unreachable
    too: the probe gives it ``UNREACHABLE_CONNECT_S`` at least (two SYN
    retransmissions).

    Every address of the host is tried at once: one that connects is enough,
    one that refuses makes it not unreachable.
    """
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    where = f"{host}:{port}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        # NOTE: an address needs no resolver (whose threads may all be busy)
        infos: list[tuple[Any, ...]] = _literal(host, port)
        if not infos:
            resolving = loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            infos = list(await asyncio.wait_for(resolving, timeout_s))
    except OSError as exc:  # TimeoutError included
        why = str(exc) or f"no answer within {timeout_s:g} s"
        return ConnectFailure(f"{host!r} not resolved: {why}", unreachable=False)
    if not infos:
        return ConnectFailure(f"{host!r} has no address", unreachable=False)
    # NOTE: by socket, not open_connection: uvloop's has no happy eyeballs
    # option, and a failure of several addresses there is one message.
    addresses = list(dict.fromkeys((family, address) for family, _, _, _, address in infos))
    attempts = [asyncio.create_task(_connect(family, address)) for family, address in addresses]
    errors: list[OSError] = []
    try:
        pending: set[asyncio.Task[OSError | None]] = set(attempts)
        while pending:
            done, pending = await asyncio.wait(
                pending, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                # NOTE: a loop that stalled past the deadline fires this timer
                # before it polls the connect that completed meanwhile (uvloop
                # runs timers first): give the poll a turn
                done, pending = await asyncio.wait(
                    pending, timeout=STALL_GRACE_S, return_when=asyncio.FIRST_COMPLETED
                )
            if not done:
                break  # the rest timed out
            for attempt in done:
                error = attempt.result()
                if error is None:
                    return None
                errors.append(error)
    finally:
        for attempt in attempts:
            attempt.cancel()
        await asyncio.gather(*attempts, return_exceptions=True)
    failed = "; ".join(str(e) or type(e).__name__ for e in errors)
    if all(e.errno in UNREACHABLE_ERRNOS for e in errors):
        if len(errors) < len(addresses):  # the others timed out
            why = f"no TCP connection to {where} within {timeout_s:g} s"
            why += f" ({failed})" if failed else ""
        else:
            why = f"no TCP connection to {where}: {failed}"
        return ConnectFailure(f"{why} (unreachable)", unreachable=True)
    refused = any(isinstance(e, ConnectionRefusedError) for e in errors)
    how = "refused" if refused else "failed"
    return ConnectFailure(f"TCP connect to {where} {how}: {failed}", unreachable=False)


async def _connect(family: int, address: tuple[Any, ...]) -> OSError | None:
    """A TCP connect to ``address``, closed at once; its error (None: it connected)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, address)
    except OSError as exc:
        return exc
    finally:
        sock.close()
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
