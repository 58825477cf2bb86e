"""The proxy's calls to engines' stores: bounded, side by side, never on the event loop.

A :class:`~fabric.transfer.store_client.StoreClient` is synchronous and serves one
call at a time (a lock), each bounded by its ``timeout_ms``. With one client
per store, concurrent requests' lookups queued behind that lock: against a
store that never answers, the n-th request waited n lookup bounds.
:class:`StoreCalls` runs every call on a thread pool of its own and gives
each caller one bound (``proxy.lookup_timeout_ms``) in all::

    caller --call(endpoint, "lookup", ...)--> admitted? (backoff) --no--> StoreSkipped at once
                |                                 |
                |   deadline = now + bound        v
                |                     a free client of the endpoint (at most
                |                     CLIENTS_PER_ENDPOINT; else wait for one)
                |                                 v
                |                     client.<method>() in a pool thread
                v                                 |
    answer, or PeerUnreachable at the deadline    +--> done: client back, outcome counted

- A caller waits at most one bound from the moment it asks (plus
  ``GRACE_S``, so that the client's own verdict, "no connection" or "no
  answer", reaches it), waiting for a free client included. A call that
  outlives its caller finishes in its thread on the client's own bound
  (the same one), then frees its client.
- Backoff: after ``BACKOFF_AFTER`` calls in a row got no answer, the store
  is skipped (:class:`StoreSkipped`, at once) for ``BACKOFF_BASE_S``,
  doubling with each further timeout up to ``BACKOFF_MAX_S``; then a single
  call tries it again (the others are still skipped until it answers).
  Any answer (a ``Refused`` included) ends the backoff; a call that failed
  in the client (a ZMQ or socket error: no answer) counts as a timeout,
  and reaches its caller as :class:`~fabric.errors.PeerUnreachable`.
- Endpoints not asked for ``idle_s``, or forgotten (a shared store
  restarted on a new port leaves its old endpoint behind), are dropped with
  their clients at the next call, once none of them is in use; the clients
  are closed in a pool thread. Kept, their sockets would reconnect forever.

Everything but the calls themselves runs on the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from fabric.errors import FabricError, PeerUnreachable
from fabric.threads import set_os_name
from fabric.transfer.store_client import StoreClient

logger = logging.getLogger(__name__)

CLIENTS_PER_ENDPOINT = 4
"""Calls one store may serve at once from this proxy (threads, sockets)."""

BACKOFF_AFTER = 2
"""Calls in a row without an answer after which a store is skipped."""

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 30.0

GRACE_S = 0.05
"""Past the bound, how long a caller still waits for the client's own error."""

IDLE_S = 300.0
"""An endpoint not asked this long is dropped, its clients closed."""


class StoreSkipped(PeerUnreachable):
    """A store is being skipped: its recent calls got no answer (backoff)."""


class _Endpoint:
    """One store: its clients, its waiting callers and its backoff."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.clients: list[StoreClient] = []  # every client made
        self.idle: list[StoreClient] = []
        self.waiters: collections.deque[asyncio.Future[StoreClient]] = collections.deque()
        self.timeouts = 0  # calls in a row without an answer
        self.skip_until = 0.0  # loop time
        self.trial = False  # a call is trying the store after its backoff
        self.used_at = 0.0  # loop time of the last call

    @property
    def idle_clients(self) -> bool:
        """No call running or waiting: every client is idle."""
        return not self.waiters and len(self.idle) == len(self.clients)

    def release(self, client: StoreClient) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(client)
                return
        self.idle.append(client)


class StoreCalls:
    """Bounded calls to stores by endpoint (see the module docstring)."""

    def __init__(
        self,
        timeout_ms: int,
        *,
        secret: str | None = None,
        max_threads: int = CLIENTS_PER_ENDPOINT,
        clients_per_endpoint: int = CLIENTS_PER_ENDPOINT,
        idle_s: float = IDLE_S,
    ) -> None:
        self.timeout_ms = timeout_ms
        self.secret = secret
        self.idle_s = idle_s
        self.clients_per_endpoint = clients_per_endpoint
        self.max_threads = max_threads
        self._executor: ThreadPoolExecutor | None = None  # made on first use
        self._endpoints: dict[str, _Endpoint] = {}
        self.in_flight = 0  # calls running in a thread (their caller may have left)
        self.timeouts = 0  # calls that got no answer within the bound
        self.skipped = 0  # calls not made: the store was backing off
        self._pruned_at = 0.0  # loop time

    @property
    def waiting(self) -> int:
        """Callers waiting for a free client."""
        return sum(len(e.waiters) for e in self._endpoints.values())

    @property
    def endpoints(self) -> list[str]:
        """The endpoints it holds clients for."""
        return list(self._endpoints)

    def backing_off(self, endpoint: str) -> bool:
        """Whether calls to ``endpoint`` are skipped now."""
        known = self._endpoints.get(endpoint)
        return known is not None and known.timeouts >= BACKOFF_AFTER

    async def call(self, endpoint: str, method: str, *args: Any, **kw: Any) -> Any:
        """``StoreClient.<method>(*args, **kw)`` on ``endpoint``, within one bound.

        Raises what the client raises (``PeerUnreachable`` for no answer,
        ``TransferError`` for a refusal), :class:`StoreSkipped` at once while
        the store backs off.
        """
        loop = asyncio.get_running_loop()
        self._prune(loop.time())
        state = self._endpoint(endpoint)
        state.used_at = loop.time()
        deadline = loop.time() + self.timeout_ms / 1000
        trial = self._admit(state, loop.time())
        try:
            client = await self._acquire(state, loop, deadline)
        except BaseException:
            if trial:
                state.trial = False
            raise
        if trial:
            pass  # NOTE: the call below is the trial; _done ends it
        elif state.timeouts >= BACKOFF_AFTER:  # backoff began while this caller waited
            state.release(client)
            self.skipped += 1
            raise StoreSkipped(self._skip_message(state, loop.time()))
        future = loop.run_in_executor(
            self._pool(), functools.partial(getattr(client, method), *args, **kw)
        )
        self.in_flight += 1
        future.add_done_callback(functools.partial(self._done, state, client, trial))
        try:
            async with asyncio.timeout_at(deadline + GRACE_S):
                return await asyncio.shield(future)
        except TimeoutError:
            raise PeerUnreachable(
                f"{endpoint}: no answer to {method} within {self.timeout_ms} ms"
            ) from None
        except (zmq.ZMQError, OSError) as exc:
            raise PeerUnreachable(f"{endpoint}: {method} failed: {exc}") from exc

    async def close(self) -> None:
        """Stop the threads and close every client (in a thread: a client
        mid-call holds its lock until its bound)."""
        clients = [c for e in self._endpoints.values() for c in e.clients]
        self._endpoints.clear()
        executor, self._executor = self._executor, None

        def close_all() -> None:
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
            for client in clients:
                client.close()

        await asyncio.to_thread(close_all)

    def forget(self, endpoint: str) -> None:
        """Drop ``endpoint`` at the next call (once no call uses it): it moved."""
        state = self._endpoints.get(endpoint)
        if state is not None:
            state.used_at = -math.inf
            self._pruned_at = -math.inf

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.max_threads,
                thread_name_prefix="fabric-proxy-store",
                initializer=set_os_name,
                initargs=("fabric-pstore",),
            )
        return self._executor

    def _prune(self, now: float) -> None:
        """Drop the endpoints idle for ``idle_s``; close their clients in a pool thread."""
        if now - self._pruned_at < min(self.idle_s, 1.0):
            return
        self._pruned_at = now
        stale = [
            e for e in self._endpoints.values() if now - e.used_at >= self.idle_s and e.idle_clients
        ]
        clients = [c for e in stale for c in e.clients]
        for e in stale:
            del self._endpoints[e.endpoint]
            logger.info(
                "store %s not asked for %.0f s: its clients are closed", e.endpoint, now - e.used_at
            )
        if clients:
            self._pool().submit(_close_all, clients)

    def _endpoint(self, endpoint: str) -> _Endpoint:
        state = self._endpoints.get(endpoint)
        if state is None:
            state = self._endpoints[endpoint] = _Endpoint(endpoint)
        return state

    def _admit(self, state: _Endpoint, now: float) -> bool:
        """Whether this call is the trial after a backoff; StoreSkipped if it may not run."""
        if state.timeouts < BACKOFF_AFTER:
            return False
        if now < state.skip_until or state.trial:
            self.skipped += 1
            raise StoreSkipped(self._skip_message(state, now))
        state.trial = True
        return True

    def _skip_message(self, state: _Endpoint, now: float) -> str:
        left = max(0.0, state.skip_until - now)
        when = f"tried again in {left:.1f} s" if left else "being tried again"
        return (
            f"{state.endpoint}: skipped, {state.timeouts} calls in a row got no answer "
            f"within {self.timeout_ms} ms ({when})"
        )

    async def _acquire(
        self, state: _Endpoint, loop: asyncio.AbstractEventLoop, deadline: float
    ) -> StoreClient:
        if state.idle:
            return state.idle.pop()
        if len(state.clients) < self.clients_per_endpoint:
            client = StoreClient(state.endpoint, timeout_ms=self.timeout_ms, secret=self.secret)
            state.clients.append(client)
            return client
        waiter: asyncio.Future[StoreClient] = loop.create_future()
        state.waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                return await waiter
        except BaseException as exc:
            if waiter in state.waiters:
                state.waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                state.release(waiter.result())  # handed a client, then gave up: pass it on
            if isinstance(exc, TimeoutError):
                raise PeerUnreachable(
                    f"{state.endpoint}: no free client within {self.timeout_ms} ms "
                    f"({self.clients_per_endpoint} calls to it are still waiting for an answer)"
                ) from None
            raise

    def _done(
        self,
        state: _Endpoint,
        client: StoreClient,
        trial: bool,
        future: asyncio.Future[Any],
    ) -> None:
        """A call ended in its thread: free its client, count its outcome."""
        self.in_flight -= 1
        if trial:
            state.trial = False
        if future.cancelled():  # never ran: the pool was shut down
            return
        error = future.exception()
        # NOTE: a FabricError other than PeerUnreachable is an answer (a
        # refusal, a bad reply); anything else failed in the client: no answer
        if error is not None and (
            isinstance(error, PeerUnreachable) or not isinstance(error, FabricError)
        ):
            self._timed_out(state)
        elif state.timeouts:
            logger.info("store %s answers again", state.endpoint)
            state.timeouts = 0
            state.skip_until = 0.0
        # NOTE: after the outcome: a caller handed this client sees the backoff it began
        if self._endpoints.get(state.endpoint) is state:
            state.release(client)

    def _timed_out(self, state: _Endpoint) -> None:
        self.timeouts += 1
        state.timeouts += 1
        if state.timeouts < BACKOFF_AFTER:
            return
        backoff = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (state.timeouts - BACKOFF_AFTER))
        state.skip_until = asyncio.get_running_loop().time() + backoff
        if state.timeouts == BACKOFF_AFTER:
            logger.warning(
                "store %s: %d calls in a row got no answer; skipped for %.0f s",
                state.endpoint,
                state.timeouts,
                backoff,
            )


def _close_all(clients: list[StoreClient]) -> None:
    for client in clients:
        client.close()
