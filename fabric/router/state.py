"""What one proxy app holds: config, engines, policy, clients, counters, tables.

Kept on ``app.state.proxy`` (a :class:`ProxyState`); nothing lives in module
globals, so two proxies can run in one process (tests do).

Control API, for whoever runs the engines in the proxy's process (``fabric
up``'s supervisor). Call it on the proxy's event loop (``state.loop`` while
the app runs; from another thread: ``loop.call_soon_threadsafe`` /
``asyncio.run_coroutine_threadsafe(..., state.loop)``). Engines are named
by name (``decode-0``) or base URL; an unknown one raises ``LookupError``::

    state = app.state.proxy                       # app = create_app(topology)
    state.set_draining("decode-0", True)          # no new requests; in-flight ones go on
    drained = await state.wait_drained("decode-0", timeout_s=60)   # outstanding == 0
    state.mark_down("decode-0", "restarting")     # not routed to; status shows down, since
    state.set_draining("decode-0", False)         # (the health probe brings it back up
                                                  #  once it answers /health; or mark_up)
    missing = await state.wait_ready(timeout_s=300)   # [] once ready, else what is missing

Per-request state, all pruned however a request ends (see :meth:`tables`,
exported as ``fabric_proxy_table_entries{table=...}`` and in
``/fabric/status``): ``requests`` (client requests in flight), ``streams``
(decoder streams being relayed), ``early_transfers`` (transfers a decoder
admitted at dispatch waits on, :mod:`fabric.router.handoff`), ``canaries`` (readiness transfers in
flight), ``store_calls`` / ``store_waiters`` (store calls in a thread /
waiting for a client, :mod:`fabric.router.stores`), ``pool_waiters`` /
``pool_busy`` (engine connections waited for / in use, httptools pool),
``engine_calls`` (calls in flight to engines, :mod:`fabric.router.calls`),
and each engine's ``outstanding``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, fields

import httpx

from fabric.config import ProxyConfig
from fabric.router.engines import (
    UNREACHABLE_CONNECT_S,
    Engine,
    EnginePool,
    describe,
    probe,
    probe_all,
    read_kv_tokens,
    tcp_connect_failure,
)
from fabric.router.handoff import WORD_TIMEOUT_MS, Handoff
from fabric.router.policy import Routing
from fabric.router.pool import open_engines
from fabric.router.prefix import fabric_threads_down
from fabric.router.ready import Readiness
from fabric.router.stores import CLIENTS_PER_ENDPOINT, StoreCalls
from fabric.router.transport import EngineHTTP, Timeouts

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    """Monotonic counters, exported on ``/metrics``.

    ``fallbacks``: requests decoded without remote KV (the prefill failed, P
    returned no ``kv_transfer_params``, or no prefiller was healthy), so the
    decoder computed the prompt itself. ``local_decodes``: requests sent
    straight to a decoder on purpose (prompt shorter than
    ``disaggregate_min_prompt_tokens``); not fallbacks. ``prefix_hits``:
    requests for which a cache-aware lookup found a prefix in some store.
    ``client_disconnects``: clients gone before their answer started (the
    work on P and D was cancelled). ``deadline_exceeded``: requests past
    ``proxy.request_deadline_s`` (504, or an error event ending the stream).
    ``pool_timeouts``: engine calls that found no free pooled connection in
    time. ``answers_too_large``: engine answers past the answer size limit.
    ``canaries`` / ``canary_failures`` / ``canaries_unverified``: readiness
    transfers that proved a P->D pair / that showed it broken / that could
    not tell (:mod:`fabric.router.canary`). ``drain_refusals``: engine
    answers that were a drain gate's 503 (the engine is marked draining;
    a decode goes to another decoder). ``early_handoffs``: requests whose
    decoder got them at dispatch (:mod:`fabric.router.handoff`);
    ``early_refused``: ones that took the sequential flow because the
    decoder held ``early_max_tokens`` already. ``first_tokens_from_prefill``:
    streams whose first token was the prefiller's (``first_token:
    prefiller``, :mod:`fabric.router.first_token`); ``first_tokens_from_decode``:
    ones that could have but whose first token was the decoder's (it came
    before P's answer, or P's failed or held a token that may not go first);
    ``first_token_mismatches``:
    ones the decoder's own first token contradicted;
    ``first_token_continuations``: of those, the ones the decoder then
    answered from the prefiller's token on (the others ended with an error
    event, or with the prefiller's token when the budget was one token). ``admin_refused``: admin
    calls refused for a missing or wrong bearer token (:mod:`fabric.router.admin`).
    Not here, counted by each engine: ``calls_cut``, engine calls (streams,
    decodes, prefills) ended because their engine became unreachable
    (:mod:`fabric.router.calls`).
    """

    requests: int = 0
    client_errors: int = 0
    fallbacks: int = 0
    local_decodes: int = 0
    prefill_errors: int = 0
    decode_errors: int = 0
    prefix_hits: int = 0
    client_disconnects: int = 0
    deadline_exceeded: int = 0
    pool_timeouts: int = 0
    answers_too_large: int = 0
    canaries: int = 0
    canary_failures: int = 0
    canaries_unverified: int = 0
    drain_refusals: int = 0
    early_handoffs: int = 0
    early_refused: int = 0
    admin_refused: int = 0
    first_tokens_from_prefill: int = 0
    first_tokens_from_decode: int = 0
    first_token_mismatches: int = 0
    first_token_continuations: int = 0

    def as_dict(self) -> dict[str, int]:
        """Counter name -> value."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(eq=False, slots=True)
class InFlight:
    """One client request, from its arrival to its end (the ``requests`` table)."""

    path: str
    started: float  # loop time
    prefill: str | None = None
    decode: str | None = None
    early: asyncio.Task[None] | None = None  # the prefill leg of an early handoff


class ProxyState:
    """State of one proxy app; the HTTP clients exist while the app runs."""

    def __init__(
        self,
        config: ProxyConfig,
        pool: EnginePool,
        policy: Routing,
        *,
        store_secret: str | None = None,
        shared_store: str | None = None,
        admin_token: str | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.counters = Counters()
        self.store_secret = store_secret  # signs the store clients' frames (connector.secret_env)
        self.admin_token = admin_token  # the admin routes' bearer token (None: open)
        self.shared_store = shared_store  # the host's shared store (connector.shared_store)
        self.shared_endpoint: str | None = None  # where it was last found
        endpoints = sum(e.kv_endpoint is not None for e in pool.engines) + bool(shared_store)
        self.stores = StoreCalls(
            config.lookup_timeout_ms,
            secret=store_secret,
            max_threads=CLIENTS_PER_ENDPOINT * max(1, endpoints),
        )
        # NOTE: not ProxyConfig fields (yet): read when present, else the defaults
        self.max_answer_bytes: int = config.max_answer_bytes
        pool_s: float | None = config.pool_timeout_s
        connect = config.connect_timeout_s
        self.prefill_timeouts = Timeouts(connect, config.prefill_timeout_s, pool_s)
        self.decode_timeouts = Timeouts(connect, config.decode_timeout_s, pool_s)
        # NOTE: an early handoff's decoder answers after the prefill too
        early_read = config.prefill_timeout_s + config.decode_timeout_s
        self.early_timeouts = Timeouts(connect, early_read, pool_s)
        self.requests: dict[str, InFlight] = {}  # transfer id -> request in flight
        # NOTE: the early handoff's words go over clients of their own (no shared backoff)
        decoders = sum(e.kv_endpoint is not None for e in pool.decoders)
        self.words = StoreCalls(
            WORD_TIMEOUT_MS,
            secret=store_secret,
            max_threads=2 * max(1, decoders),
            clients_per_endpoint=2,
        )
        self.handoff = Handoff(self.words.call)  # early handoffs' decoders waiting
        self.streams = 0  # decoder streams open (relay.Relay)
        # D's own first token after P's answer (first_token: prefiller): sum, count
        self.first_token_lag_s = 0.0
        self.first_token_lags = 0
        self.tokenize_turn = 0  # which engine the next /tokenize goes to (prefix.py)
        self.readiness = Readiness(self)
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's, while it runs
        self._client: httpx.AsyncClient | None = None
        self._engines: EngineHTTP | None = None
        self._reach_checks: dict[Engine, asyncio.Task[None]] = {}  # see connect_failed

    @property
    def in_flight(self) -> int:
        """Client requests in flight (arrived, not yet answered to their end)."""
        return len(self.requests)

    def oldest_request_s(self) -> float | None:
        """How long the oldest request in flight has been (None: none is)."""
        if not self.requests or self.loop is None:
            return None
        return self.loop.time() - min(r.started for r in self.requests.values())

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared httpx client (probes, admin routes); only while the app runs."""
        if self._client is None:
            raise RuntimeError("the proxy's HTTP client is not open (app not started)")
        return self._client

    @property
    def engines(self) -> EngineHTTP:
        """The engine client of the PD flow (same pool as :attr:`client`)."""
        if self._engines is None:
            raise RuntimeError("the proxy's HTTP client is not open (app not started)")
        return self._engines

    def open_client(self) -> httpx.AsyncClient:
        """Open the clients, sized for ``max_connections`` per engine (on the app's loop)."""
        self.loop = asyncio.get_running_loop()
        size = self.config.max_connections * max(1, len(self.pool.engines))
        timeout = httpx.Timeout(self.config.decode_timeout_s, connect=self.config.connect_timeout_s)
        self._engines, self._client = open_engines(self.config.max_connections, size, timeout)
        return self._client

    async def close_client(self) -> None:
        """Stop readiness checks; close the clients and the store clients."""
        await self.readiness.close()
        await self.handoff.close()
        await self.words.close()
        await self.stores.close()
        checks = list(self._reach_checks.values())
        for check in checks:
            check.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
        if self._engines is not None:
            await self._engines.aclose()
            self._engines = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self.loop = None

    async def learn_kv_sizes(self) -> None:
        """Read every decoder's KV size once at start (the early handoff's
        budget; the health probe reads it again each time one comes back)."""
        await asyncio.gather(
            *(
                read_kv_tokens(self.client, e, self.config.health_timeout_s)
                for e in self.pool.decoders
            )
        )

    async def probe_engines(self) -> None:
        """Probe every engine's ``/health`` (and its fabric side) now."""
        check = functools.partial(fabric_threads_down, self)
        await probe_all(self.client, self.pool, self.config.health_timeout_s, check)

    async def probe_engine(self, engine: Engine) -> bool:
        """Probe one engine now, as the health loop does (``/health``, then its
        fabric side); whether it is healthy. One found back (a new epoch: its
        pairs are pending, used only where no checked pair exists) gets its
        canaries now, not at the health loop's next round."""
        check = functools.partial(fabric_threads_down, self)
        epoch = engine.epoch
        healthy = await probe(self.client, engine, self.config.health_timeout_s, check)
        if healthy and engine.epoch != epoch:
            self.readiness.tick()
        return healthy

    def connect_failed(
        self, engine: Engine, exc: httpx.ConnectError | httpx.ConnectTimeout
    ) -> None:
        """A request could not connect to ``engine``: it is down now. A connect
        that timed out is tried again in the background on a fresh TCP
        connection, as the health probe does: if that times out too (or finds
        no route) the engine is unreachable and its calls in flight are cut; a
        refused one cuts nothing.

        NOTE: not at once: a connect also times out on an engine that is
        reachable but too busy to accept (its listen backlog full).
        """
        engine.mark_down(describe(exc))
        if isinstance(exc, httpx.ConnectTimeout) and engine not in self._reach_checks:
            check = asyncio.create_task(self._check_reach(engine, describe(exc)))
            self._reach_checks[engine] = check

    async def _check_reach(self, engine: Engine, why: str) -> None:
        try:
            connect_s = max(self.config.health_timeout_s, UNREACHABLE_CONNECT_S)
            failure = await tcp_connect_failure(engine.url, connect_s)
            if failure is not None and failure.unreachable:  # refused: down already
                engine.mark_unreachable(f"{why}; {failure.reason}")
        finally:
            del self._reach_checks[engine]

    def tables(self) -> dict[str, int]:
        """Entries of each per-request table (0 for all once nothing is in flight)."""
        tables = {
            "requests": len(self.requests),
            "streams": self.streams,
            "canaries": self.readiness.in_flight,
            "store_calls": self.stores.in_flight + self.words.in_flight,
            "store_waiters": self.stores.waiting + self.words.waiting,
            "early_transfers": self.handoff.waiting,
            "engine_calls": sum(len(e.calls) for e in self.pool.engines),
        }
        if self._engines is not None:
            tables |= self._engines.tables()
        return tables

    def first_token_lag(self, seconds: float) -> None:
        """Count how long after P's answer D's own first token came."""
        self.first_token_lag_s += seconds
        self.first_token_lags += 1

    def counter_values(self) -> dict[str, int]:
        """Every counter: the proxy's and its store calls'."""
        return self.counters.as_dict() | {
            "store_timeouts": self.stores.timeouts,
            "store_skipped": self.stores.skipped,
            "prefill_words_failed": self.handoff.failed_words,
            "calls_cut": sum(e.calls.cut_total for e in self.pool.engines),
        }

    # --- control API (see the module docstring) -----------------------------

    def engine(self, name_or_url: str) -> Engine:
        """The engine with that name or base URL; LookupError if none."""
        return self.pool.find(name_or_url)

    def set_draining(self, name_or_url: str, draining: bool = True) -> Engine:
        """Stop (True) or resume (False) routing new requests to an engine."""
        engine = self.engine(name_or_url)
        engine.set_draining(draining)
        return engine

    def mark_down(self, name_or_url: str, reason: str) -> Engine:
        """Take an engine out of rotation now (the health probe brings it back
        once it answers ``/health``; keep it out with :meth:`set_draining`)."""
        engine = self.engine(name_or_url)
        engine.mark_down(reason)
        return engine

    def mark_up(self, name_or_url: str) -> Engine:
        """Put an engine back in rotation now (its canaries run again)."""
        engine = self.engine(name_or_url)
        engine.mark_up()
        return engine

    async def wait_drained(self, name_or_url: str, timeout_s: float) -> bool:
        """Until an engine has nothing outstanding (True) or ``timeout_s`` passed."""
        return await self.engine(name_or_url).wait_idle(timeout_s)

    async def wait_ready(self, timeout_s: float) -> list[str]:
        """Until the proxy is ready (``[]``), or what is still missing after ``timeout_s``.

        Probes the engines and runs the due canaries meanwhile (see
        :meth:`fabric.router.ready.Readiness.wait`); needs the app running.
        """
        return await self.readiness.wait(timeout_s)
