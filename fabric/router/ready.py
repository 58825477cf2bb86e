"""Readiness: every engine answers, and every P->D pair moved KV end to end.

The proxy is ready (``GET /health`` 200, :meth:`Readiness.wait` returns
``[]``) when:

- every engine that is not draining answered its latest ``/health`` probe
  (its fabric side included, see :func:`fabric.router.prefix.fabric_threads_down`);
- at least one decoder can be routed to;
- every pair (P, D) of such engines passed a canary (a KV transfer through
  the PD path, see :mod:`fabric.router.canary`) since either of them last
  came back up (an engine's ``epoch``).

Until then ``/health`` is a 503 whose ``missing`` list says what is not
there yet. A pair's state (:class:`PairState`, in ``/health``'s and
``/fabric/status``'s ``pairs``):

    pending ---canary---> ok           KV moved end to end
       ^          |-----> unverified   the canary could not tell (401/403,
       |          |                    no fabric metrics, timeout, busy):
       |          |                    still routed, retried, not ready
       |          +-----> failed       evidence the transfer is broken (a
       |                               load failure, no kv_transfer_params,
       |                               a refusal): not routed, retried
       +-- either engine comes back up (a new epoch)

Routing (:data:`fabric.router.policy.PairRank`): a failed pair is not used
(its decoder gets requests from the other prefillers, or computes the
prompt itself when none is left); ok and unverified pairs are used; a
pending pair only when no checked (ok or unverified) pair exists for the
request. Before the first canaries end every pair is pending, so the proxy
routes as it would without them. A failed pair does not keep the other
pairs from serving.

When they run: readiness is watched from the first time someone asks (a
``GET /health`` or :meth:`Readiness.wait`), so a proxy nobody asks sends no
canary traffic. From then on each background health tick
(``health_interval_s`` > 0), each ``GET /health`` and each round of
:meth:`Readiness.wait` starts the due canaries in the background: a pending
pair whose engines are both up, and an unverified or failed pair
``retry_s`` after its last try. Each pair's canary is a task of its own,
and each decoder runs one canary at a time (so a canary sees its own load
on the decoder's counters): a canary that hangs until its timeout holds up
only the canaries of its decoder. Draining or down engines get none.

A decoder unreachable at start is down: the proxy serves through the other
decoders but is not ready; ``/health`` names it, :meth:`Readiness.wait`
returns it at its timeout. Once a probe sees it answer, its pairs' canaries
run and the proxy turns ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from fabric.router.canary import CanaryFailed, CanaryUnverified, run_canary
from fabric.router.engines import Engine, describe

if TYPE_CHECKING:
    from fabric.router.state import ProxyState

logger = logging.getLogger(__name__)

CANARY_TIMEOUT_S = 60.0
"""The most one canary may take (``proxy.request_deadline_s`` when shorter)."""
RETRY_S = 5.0
"""An unverified or failed pair's canary is tried again this long after its last try."""
WAIT_POLL_S = 0.5

CHECKED_RANK = 0
"""A pair's rank (:data:`fabric.router.policy.PairRank`): checked (ok, unverified)."""
PENDING_RANK = 1
"""A pair's rank: not checked since an engine came back (used when nothing better)."""


class PairState(enum.Enum):
    """What the last canary of a P->D pair found."""

    PENDING = "pending"  # not checked since its engines (re)started
    OK = "ok"
    UNVERIFIED = "unverified"  # the canary could not tell: still routed
    FAILED = "failed"  # the transfer is broken: not routed


@dataclass(eq=False)
class Pair:
    """One prefiller and one decoder, and what their last canary found."""

    prefill: Engine
    decode: Engine
    result: PairState = PairState.PENDING
    error: str | None = None
    checked_at: float | None = None  # wall clock of the last canary's end
    epochs: tuple[int, int] | None = None  # the engines' epochs it was checked at
    next_try: float = 0.0  # loop time

    @property
    def name(self) -> str:
        return f"{self.prefill.name} -> {self.decode.name}"

    @property
    def current(self) -> bool:
        """Whether its result is about the engines as they run now."""
        return self.epochs == (self.prefill.epoch, self.decode.epoch)

    @property
    def state(self) -> PairState:
        return self.result if self.current else PairState.PENDING

    def as_dict(self) -> dict[str, Any]:
        state = self.state
        reported = state in (PairState.FAILED, PairState.UNVERIFIED)
        return {
            "prefill": self.prefill.name,
            "decode": self.decode.name,
            "state": state.value,
            "error": self.error if reported else None,
            "checked_at": self.checked_at,
        }


class Readiness:
    """The readiness of one proxy (see the module docstring); on ``ProxyState.readiness``."""

    def __init__(self, state: ProxyState) -> None:
        self._state = state
        pool = state.pool
        self.pairs = [Pair(p, d) for d in pool.decoders for p in pool.prefillers]
        self._by_engines = {(pair.prefill, pair.decode): pair for pair in self.pairs}
        self.active = False  # someone asked: canaries run from now on
        self.retry_s = RETRY_S
        self.timeout_s = min(CANARY_TIMEOUT_S, state.config.request_deadline_s)
        self.in_flight = 0  # canaries running
        self._tasks: dict[Pair, asyncio.Task[None]] = {}  # a pair's canary, waiting or running
        self._locks: dict[Engine, asyncio.Lock] = {}  # one canary per decoder at a time

    def rank(self, prefill: Engine, decode: Engine) -> int | None:
        """How requests may go from ``prefill`` to ``decode`` (see
        :data:`fabric.router.policy.PairRank`): None for a failed pair."""
        pair = self._by_engines.get((prefill, decode))
        if pair is None:
            return CHECKED_RANK
        state = pair.state
        if state is PairState.FAILED:
            return None
        return PENDING_RANK if state is PairState.PENDING else CHECKED_RANK

    @property
    def ready(self) -> bool:
        return not self.missing()

    def missing(self) -> list[str]:
        """What keeps the proxy from being ready, one line each (``[]``: ready)."""
        pool = self._state.pool
        out = []
        for engine in pool.engines:
            if engine.draining:
                continue
            if not engine.healthy:
                out.append(f"{engine.name}: down ({engine.last_error})")
            elif not engine.answered:
                out.append(f"{engine.name}: has not answered /health yet")
        if not any(d.routable for d in pool.decoders):
            out.append("no decoder to route to (every one is down or draining)")
        for pair in self.pairs:
            p, d = pair.prefill, pair.decode
            if p.draining or d.draining or not (p.healthy and d.healthy):
                continue  # NOTE: a down engine is reported above; a draining one is not needed
            state = pair.state
            if state is PairState.PENDING:
                out.append(f"{pair.name}: canary pending")
            elif state is PairState.UNVERIFIED:
                out.append(f"{pair.name}: canary unverified (pair still used): {pair.error}")
            elif state is PairState.FAILED:
                out.append(f"{pair.name}: canary failed: {pair.error}")
        return out

    def kick(self) -> None:
        """Watch readiness from now on, and start the due canaries in the background."""
        self.active = True
        for pair in self._due():
            task = asyncio.create_task(self._canary(pair), name=f"fabric-canary {pair.name}")
            self._tasks[pair] = task
            task.add_done_callback(functools.partial(self._ended, pair))

    def tick(self) -> None:
        """A background health tick: the due canaries, once readiness is watched."""
        if self.active:
            self.kick()

    async def wait(self, timeout_s: float) -> list[str]:
        """Probe the engines and run the due canaries until ready (``[]``) or
        ``timeout_s`` passed (what is still missing)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._state.probe_engines()
            self.kick()
            running = set(self._tasks.values())
            if running:
                await asyncio.wait(
                    running,
                    timeout=max(0.0, deadline - loop.time()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            missing = self.missing()
            left = deadline - loop.time()
            if not missing or left <= 0:
                return missing
            if not running:
                await asyncio.sleep(min(WAIT_POLL_S, left))

    async def close(self) -> None:
        """Cancel the canaries in flight."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _due(self) -> list[Pair]:
        now = asyncio.get_running_loop().time()
        return [
            pair
            for pair in self.pairs
            if pair not in self._tasks
            and (pair.state is not PairState.OK)
            and (not pair.current or now >= pair.next_try)
            and _checkable(pair)
        ]

    def _ended(self, pair: Pair, task: asyncio.Task[None]) -> None:
        if self._tasks.get(pair) is task:
            del self._tasks[pair]

    async def _canary(self, pair: Pair) -> None:
        lock = self._locks.setdefault(pair.decode, asyncio.Lock())
        async with lock:
            if not _checkable(pair):  # NOTE: an engine went down or draining meanwhile
                return
            epochs = (pair.prefill.epoch, pair.decode.epoch)
            self.in_flight += 1
            try:
                outcome = await self._outcome(pair)
            finally:
                self.in_flight -= 1
            self._record(pair, epochs, *outcome)

    async def _outcome(self, pair: Pair) -> tuple[PairState, str | None]:
        """The canary's verdict on ``pair`` and why (None when it passed)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await run_canary(self._state, pair.prefill, pair.decode)
        except CanaryFailed as exc:
            return PairState.FAILED, str(exc)
        except CanaryUnverified as exc:
            return PairState.UNVERIFIED, str(exc)
        except TimeoutError:
            return PairState.UNVERIFIED, f"no end within {self.timeout_s:g} s"
        except httpx.HTTPError as exc:
            return PairState.UNVERIFIED, describe(exc)
        except Exception as exc:  # NOTE: a canary's bug proves nothing about the pair
            logger.exception("canary %s: unexpected error", pair.name)
            return PairState.UNVERIFIED, f"proxy error: {describe(exc)}"
        return PairState.OK, None

    def _record(
        self, pair: Pair, epochs: tuple[int, int], result: PairState, error: str | None
    ) -> None:
        was = pair.state
        pair.result, pair.error, pair.epochs = result, error, epochs
        pair.checked_at = time.time()
        pair.next_try = asyncio.get_running_loop().time() + self.retry_s
        counters = self._state.counters
        if result is PairState.OK:
            counters.canaries += 1
            logger.info("canary %s: KV moved end to end", pair.name)
        elif result is PairState.FAILED:
            counters.canary_failures += 1
            if was is not PairState.FAILED:
                logger.warning("canary %s failed (pair not used): %s", pair.name, error)
        else:
            counters.canaries_unverified += 1
            if was is not PairState.UNVERIFIED:
                logger.warning("canary %s unverified (pair still used): %s", pair.name, error)


def _checkable(pair: Pair) -> bool:
    """Whether both engines may get a canary: up, answering, not draining."""
    return all(e.routable and e.answered for e in (pair.prefill, pair.decode))
