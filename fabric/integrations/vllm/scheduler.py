"""Scheduler side of the FabricConnector (runs in vLLM's EngineCore).

Prefiller (request carries ``do_remote_decode``): every step, chunks whose
tokens are all computed once the step has run become ``PackChunk``s; the
worker packs them after that step (on its pack thread, joined before the
next forward) and pushes them while the rest of the prompt is still
computing. Nothing holds vLLM's blocks past the next forward, so
``request_finished`` never delays a free.

    prompt:   | chunk 0 | chunk 1 | chunk 2 |c3|    (chunk_tokens each)
    step 1:   [ computed ][....]                  -> pack chunk 0
    step 2:             [ computed.............]  -> pack chunks 1, 2, 3

Decoder (request carries ``do_remote_prefill`` + ``transfer_id``): every
prompt token beyond the local prefix hit is reported as loadable
asynchronously; once vLLM allocated the blocks a ``LoadPlan`` tells the
worker where to unpack. vLLM recomputes the last prompt token itself.

Reuse tier (any role, any other request): before vLLM computes a prompt the
scheduler asks its worker's store how many leading full chunks it holds
(``TierClient.ask``, which also holds them for this request); those
tokens load synchronously (a ``LocalLoad`` unpacked before the forward pass)
and vLLM computes only the rest. The full chunks the engine computes are
packed into its store as they complete (keep-only ``SendPlan``), so the next
prompt with the same prefix finds them.

    prompt:   | chunk 0 | chunk 1 | chunk 2 |c3|
    store:    [ held    ][ held   ]             -> LocalLoad chunks 0, 1
    vLLM:                          [ computes      ] -> pack chunk 2

Shared store (``shared_store``): when the engine's own store holds less than
the usable prefix, the scheduler asks the host's shared store to fetch the
prompt (``SharedTier.ask``). If the shared store holds
more chunks, it pushes them into this engine's store as a transfer, exactly
as a prefiller pushes to a decoder, and the request loads asynchronously
(``(n, True)``, a ``LoadPlan`` the worker's Loader completes; chunks the own
store already had are reserved as present and not sent). One fetch per
request; a failed load makes vLLM recompute.

    prompt:   | chunk 0 | chunk 1 | chunk 2 | chunk 3 |c4|
    store:    [ held    ]                               -> released
    shared:   [ held    ][ held   ][ held   ]           -> Fetch: chunks 1, 2 pushed
    vLLM:     (waits for the load)                  [ computes ] -> pack chunk 3

Asking never waits across a step (see
:mod:`fabric.integrations.vllm.tier_client`): a lookup or fetch is sent on
the request's first ask, which waits at most what is left of the step's
``lookup_timeout_ms`` (one budget for all the step's asks, reset by
``build_connector_meta``); not answered by then, the request answers
``(None, False)`` and vLLM asks again next step (later asks do not wait).
A lookup or fetch that fails, or is not answered by ``lookup_deadline_ms``,
is a miss: vLLM computes the prompt.

    step 1  ask r1: Lookup sent, wait <= what is left of the step's wait -> (None, False)
    step 2  ask r1: answers not all in                                   -> (None, False)
    step 3  ask r1: every rank answered: 2 chunks                        -> (2 * chunk, False)

When a looked-up hit goes unused (a miss, a hit vLLM did not take, a
request that ends first, a lookup given up on), the scheduler releases the
request's hold in the next step's metadata; a late answer saying a rank
held for a lookup given up on is released the same way (:meth:`_late_holds`),
so no hold waits for its lease.

Per-request tables and when they are pruned (vLLM 0.32,
``vllm/v1/core/sched/scheduler.py``):

    _sending, _receiving, _attempted, _hits, _identities, _claimed
        request_finished. vLLM calls it for every request that ends, however:
        finished (update_from_output -> _free_request, :2230), aborted or
        client gone, running or still waiting without blocks
        (finish_requests -> _free_request, :2710 -> _connector_finished,
        :2723 -> request_finished, :3051), failed with an error (the same
        finish_requests). A failed load (:3341) or a preemption only sends
        the request back to the queue: it asks again, one load attempt
        (``_attempted``), and ends through request_finished like any other.
        ``_hits`` and ``_receiving`` are also dropped once vLLM allocated
        the request (update_state_after_alloc).
    _loads, _local_loads, _releases, _claims, _unclaims
        drained by every build_connector_meta (once per schedule(), :1529).
        After a request ends vLLM runs one more schedule() to tell the
        workers (has_finished_requests, :2813), which drains what its end
        queued.
    scheduler_lookups, scheduler_fetches (the tier clients' asks in flight)
        answered, past their deadline, or given up on by request_finished
        or update_state_after_alloc.
    scheduler_lookups_abandoned, scheduler_fetches_abandoned
        asks given up on, watched for their late answer; at most
        ``MAX_IN_FLIGHT`` per peer, read by every build_connector_meta and
        forgotten once answered or past their lease.

:meth:`FabricScheduler.report_tables` records their sizes once per step
(``vllm:fabric_table_entries``); 0 when no request is in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fabric.errors import ConfigError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import FabricCounters
from fabric.integrations.vllm.identity import request_identity
from fabric.integrations.vllm.metadata import (
    Claim,
    FabricMetadata,
    LoadPlan,
    LocalLoad,
    PackChunk,
    SendPlan,
)
from fabric.integrations.vllm.tier_client import OVERRUN_S  # NOTE: such an ask is counted
from fabric.kv.spans import chunk_block_counts

if TYPE_CHECKING:
    from fabric.kv.identity import KeyIdentity

logger = logging.getLogger(__name__)


_SCHEDSTAT = "/proc/thread-self/schedstat"  # NOTE: "cpu_ns run_delay_ns timeslices"
HAS_SCHEDSTAT = os.path.exists(_SCHEDSTAT)
# NOTE: .fd: the asking thread's schedstat (vLLM's engine-core thread), opened once, kept
_schedstat = threading.local()


def run_queue_s() -> float:
    """Seconds this thread has waited on a run queue (runnable, not running),
    from ``/proc/thread-self/schedstat``; 0.0 where the kernel has none
    (``HAS_SCHEDSTAT`` False: the overrun's run-queue counter is not kept).
    The file stays open per thread (one ``pread`` per call: asks run every
    step)."""
    if not HAS_SCHEDSTAT:
        return 0.0
    fd = getattr(_schedstat, "fd", None)
    try:
        if fd is None:
            fd = _schedstat.fd = os.open(_SCHEDSTAT, os.O_RDONLY)
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class RequestLike(Protocol):
    request_id: str
    prompt_token_ids: list[int] | None
    kv_transfer_params: dict[str, Any] | None


class TierClient(Protocol):
    """The scheduler's line to its worker's reuse tier (answers across steps)."""

    def ask(
        self, request_id: str, token_ids: list[int], identity: KeyIdentity, wait_s: float
    ) -> int | None:
        """Leading full chunks of ``token_ids`` (keyed with ``identity``)
        held, now held for the request (0 when the worker cannot be asked);
        None: not answered yet, ask again later. Only a request's first ask
        waits, at most ``wait_s``."""

    def asked_at(self, request_id: str) -> float | None:
        """When the request's lookup in flight was started (a worker's hold
        is at most that old when its answer is taken); None: none in flight."""
        ...

    def cancel(self, request_id: str) -> bool:
        """Give up on the request's lookup; True when a worker may hold for it."""
        ...

    def poll(self) -> list[str]:
        """Once per step, no wait: requests a given-up lookup left a hold for."""
        ...

    def table_sizes(self) -> dict[str, int]: ...


class SharedTier(Protocol):
    """The scheduler's line to the host's shared store (answers across steps)."""

    def ask(
        self,
        transfer_id: str,
        token_ids: list[int],
        min_chunks: int,
        identity: KeyIdentity,
        wait_s: float,
    ) -> int | None:
        """Leading full chunks of ``token_ids`` the shared store now pushes into
        this engine as ``transfer_id``; 0 when it pushes nothing (it holds at
        most ``min_chunks``, or it cannot be asked); None: not answered yet,
        ask again later. Only the first ask of a fetch waits, at most ``wait_s``."""
        ...

    def cancel(self, transfer_id: str) -> None: ...

    def poll(self) -> None:
        """Once per step, no wait: take the answers that came."""
        ...

    def table_sizes(self) -> dict[str, int]: ...


@dataclass
class _Sending:
    req_id: str
    transfer_id: str | None  # None: keep only (reuse tier), nothing pushed
    endpoint: str | None
    token_ids: list[int]
    chunk_blocks: list[int]
    identity: KeyIdentity
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0
    announced: bool = False


@dataclass
class _Receiving:
    transfer_id: str
    num_tokens: int
    num_local_tokens: int
    identity: KeyIdentity
    shared: bool = False  # a fetch from the shared store, not a PD transfer


@dataclass
class _Hit:
    tokens: int  # chunk-aligned prefix tokens the store holds for the request
    at: float  # when it was looked up (and held)
    # NOTE: 0 tokens does not mean nothing is held: a rank may hold more
    # than the smallest hit, or held before its answer came too late.
    fetch: str | None = None  # the shared-store fetch in flight (its transfer id)
    fetched: bool = False  # the shared store answered for this hit


class FabricScheduler:
    """Per-request bookkeeping for pushes (prefiller), loads (decoder) and reuse."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        *,
        produce: bool,
        consume: bool,
        tier: TierClient | None = None,
        shared: SharedTier | None = None,
        clock: Any = time.monotonic,
        counters: FabricCounters | None = None,
    ) -> None:
        if config.chunk_tokens % block_size:
            raise ConfigError(
                f"kv_connector_extra_config.chunk_tokens: {config.chunk_tokens} is not a "
                f"multiple of vLLM's block size {block_size}"
            )
        self.config, self.block_size = config, block_size
        self.produce, self.consume = produce, consume
        self._sending: dict[str, _Sending] = {}
        self._receiving: dict[str, _Receiving] = {}
        self._loads: list[LoadPlan] = []
        # NOTE: a failed load makes vLLM reschedule the request from scratch,
        # asking again; one load attempt per request, then it computes.
        self._attempted: set[str] = set()
        self.tier, self.shared, self._clock = tier, shared, clock
        self.counters = counters if counters is not None else FabricCounters()
        self._hits: dict[str, _Hit] = {}
        # NOTE: None = a request fabric cannot key: it bypasses fabric.
        self._identities: dict[str, KeyIdentity | None] = {}
        self._local_loads: list[LocalLoad] = []
        self._releases: list[str] = []
        self._claims: list[Claim] = []
        self._unclaims: list[str] = []
        self._claimed: set[str] = set()  # claimed requests vLLM has not allocated yet
        # NOTE: a request waiting for blocks asks again every step; its hit is
        # looked up once and refreshed only before the hold's lease could end.
        self._hit_refresh_s = config.lease_ms / 2000
        # NOTE: what the step's first asks may wait for answers, all together.
        self._step_wait_s = self._wait_left = config.lookup_timeout_ms / 1000
        self._waited_s = 0.0  # NOTE: the step's time inside asks (scheduler_wait_seconds)

    # ------------------------------------------------------------ identity
    def identity(self, request: RequestLike) -> KeyIdentity | None:
        """The request's key identity (computed once); None: fabric cannot key
        it, so it bypasses fabric (no lookup, no pack, no load; counted)."""
        rid = request.request_id
        if rid in self._identities:
            return self._identities[rid]
        identity = request_identity(request)
        self._identities[rid] = identity
        if identity is None:
            self.counters.add(bypassed_requests=1)
            logger.info(
                "request %s: an input fabric cannot key (prompt embeddings, an unreadable "
                "LoRA adapter or a multimodal item without identifier); vLLM computes it "
                "without fabric",
                rid,
            )
        return identity

    # ------------------------------------------------------------ reuse tier
    def _local_match(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own prefix hit that the store holds (sync
        load) or the shared store pushes (async); None: not answered yet."""
        rid = request.request_id
        tokens = list(request.prompt_token_ids or [])
        chunk_tokens = self.config.chunk_tokens
        # vLLM must compute at least the last prompt token itself.
        usable = (len(tokens) - 1) // chunk_tokens * chunk_tokens
        # NOTE: vLLM takes 0 for these whatever we say (vllm/v1/core/sched/scheduler.py:983).
        skips_cache = getattr(request, "skip_reading_prefix_cache", False)
        if self.tier is None or usable <= num_computed_tokens or skips_cache:
            self._forget_lookup(rid)
            return 0, False
        identity = self.identity(request)
        if identity is None:
            return 0, False
        fetching = self._receiving.get(rid)
        if fetching is not None:  # asked again while it waits for blocks
            if fetching.num_tokens > num_computed_tokens:
                fetching.num_local_tokens = num_computed_tokens
                return fetching.num_tokens - num_computed_tokens, True
            del self._receiving[rid]
        hit = self._look_up(rid, tokens[:usable], identity)
        if hit is None:
            return None, False
        have = max(hit.tokens, num_computed_tokens)
        if have < usable:
            fetched = self._fetch_shared(rid, hit, tokens[:usable], have, identity)
            if fetched is None:
                return None, False
            if fetched:
                recv = self._receiving[rid]
                recv.num_local_tokens = num_computed_tokens
                return recv.num_tokens - num_computed_tokens, True
        if hit.tokens <= num_computed_tokens:
            return 0, False
        return hit.tokens - num_computed_tokens, False

    def _look_up(self, rid: str, tokens: list[int], identity: KeyIdentity) -> _Hit | None:
        """The request's hit (looked up once, refreshed before its hold's
        lease could end); None while the lookup is not answered."""
        tier = self.tier
        assert tier is not None
        hit = self._hits.get(rid)
        now = self._clock()
        if hit is not None and now - hit.at <= self._hit_refresh_s:
            return hit
        # NOTE: an answer taken steps later (vLLM may not ask again while its
        # batch is full) dates the hit from the ask, not from the answer
        started = tier.asked_at(rid)
        chunks = self._waited(lambda wait_s: tier.ask(rid, tokens, identity, wait_s))
        if chunks is None:
            return None  # NOTE: a refresh in flight keeps the old hit until answered
        tokens_held = min(chunks * self.config.chunk_tokens, len(tokens))
        if hit is not None and hit.fetch is not None and self.shared is not None:
            self.shared.cancel(hit.fetch)
        hit = self._hits[rid] = _Hit(tokens_held, now if started is None else min(started, now))
        return hit

    def _fetch_shared(
        self, rid: str, hit: _Hit, tokens: list[int], have: int, identity: KeyIdentity
    ) -> int | None:
        """Ask the shared store for more than the ``have`` tokens held here
        (once per hit; one fetch that pushes per request). On a longer hit,
        drop the own store's hold and record the push as ``_receiving``;
        its tokens, 0 for none, None while the shared store has not answered."""
        if self.shared is None or rid in self._attempted or hit.fetched:
            return 0
        chunk_tokens = self.config.chunk_tokens
        transfer_id = hit.fetch = hit.fetch or f"shared-{rid}-{uuid.uuid4().hex[:8]}"
        shared = self.shared
        chunks = self._waited(
            lambda wait_s: shared.ask(transfer_id, tokens, have // chunk_tokens, identity, wait_s)
        )
        if chunks is None:
            return None
        hit.fetch, hit.fetched = None, True
        num_tokens = min(chunks * chunk_tokens, len(tokens))
        if num_tokens <= have:
            return 0
        self._attempted.add(rid)
        self._drop_hit(rid)  # NOTE: chunks the store still has are reserved as present
        self._receiving[rid] = _Receiving(transfer_id, num_tokens, 0, identity, shared=True)
        return num_tokens

    def _waited(self, ask: Callable[[float], int | None]) -> int | None:
        """``ask(wait_s)`` within what is left of the step's wait.

        An ask that ran more than ``OVERRUN_S`` past its wait is counted
        (``scheduler_wait_overruns``) with the thread's CPU time in it and
        the time the OS kept it waiting to run (``/proc/thread-self/
        schedstat``); the rest of the overrun the thread was blocked: on the
        GIL (the worker's threads share the process at TP 1), a lock, or a
        poll that woke late."""
        start, cpu, queued = time.perf_counter(), time.thread_time(), run_queue_s()
        wait_s = self._wait_left
        try:
            return ask(wait_s)
        finally:
            spent = time.perf_counter() - start
            self._waited_s += spent
            self._wait_left = max(0.0, self._wait_left - spent)
            if spent > wait_s + OVERRUN_S:
                overrun = {
                    "scheduler_wait_overruns": 1,
                    "scheduler_wait_overrun_us": round((spent - wait_s) * 1e6),
                    "scheduler_wait_overrun_cpu_us": round((time.thread_time() - cpu) * 1e6),
                }
                if HAS_SCHEDSTAT:
                    overrun["scheduler_wait_overrun_runq_us"] = round(
                        (run_queue_s() - queued) * 1e6
                    )
                self.counters.add(**overrun)

    def _drop_hit(self, rid: str) -> None:
        """Forget the request's hit; release whatever any rank holds for it."""
        hit = self._hits.pop(rid, None)
        if hit is None:
            return
        if hit.fetch is not None and self.shared is not None:
            self.shared.cancel(hit.fetch)
        self._release(rid)

    def _forget_lookup(self, rid: str) -> None:
        """Give up on the request's lookup in flight and drop its hit; a rank
        that got the lookup is told to release (now, and again when its late
        answer says it held: see :meth:`_late_holds`)."""
        if self.tier is not None and self.tier.cancel(rid):
            self._release(rid)
        self._drop_hit(rid)

    def _release(self, rid: str) -> None:
        if rid not in self._releases:
            self._releases.append(rid)

    def _late_holds(self) -> None:
        """Release what given-up lookups held, unless the request uses a newer
        hold: a hit it still counts on, or a LocalLoad of this step (the
        worker runs the step's releases before its loads)."""
        if self.shared is not None:
            self.shared.poll()
        if self.tier is None:
            return
        loading = {load.req_id for load in self._local_loads}
        for rid in self.tier.poll():
            hit = self._hits.get(rid)
            if rid not in loading and (hit is None or not hit.tokens):
                self._release(rid)

    # ------------------------------------------------------------ decoder
    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` to load, and whether
        asynchronously (vLLM asks for a waiting request with nothing computed,
        ``vllm/v1/core/sched/scheduler.py:979``). ``(None, False)`` while its
        store or the shared store has not answered: vLLM skips the request
        this step and asks again (``vllm/distributed/kv_transfer/kv_connector/
        v1/base.py:501-531``, scheduler.py:986-991)."""
        params = request.kv_transfer_params or {}
        if not (self.consume and params.get("do_remote_prefill")):
            return self._local_match(request, num_computed_tokens)
        if request.request_id in self._attempted:
            return 0, False
        identity = self.identity(request)
        if identity is None:
            return 0, False
        transfer_id = params.get("transfer_id")
        num_tokens = len(request.prompt_token_ids or [])
        why = self._refuse_params(params, num_tokens)
        if why:
            self._attempted.add(request.request_id)
            self.counters.add(refused_transfers=1)
            logger.warning(
                "request %s: refusing the pushed KV (%s); computing the prompt locally",
                request.request_id,
                why,
            )
            return 0, False
        if num_computed_tokens >= num_tokens:
            return 0, False
        assert isinstance(transfer_id, str)
        self._receiving[request.request_id] = _Receiving(
            transfer_id, num_tokens, num_computed_tokens, identity
        )
        return num_tokens - num_computed_tokens, True

    def on_new_request(self, request: RequestLike) -> None:
        """A request vLLM just queued (``Scheduler.add_request``,
        ``vllm/v1/core/sched/scheduler.py:2640``, before it is ever
        scheduled): a decoder claims its transfer, so what is pushed for it
        is kept while it waits for blocks (see
        :class:`~fabric.integrations.vllm.loader.Loader`)."""
        params = request.kv_transfer_params or {}
        transfer_id = params.get("transfer_id")
        if self.consume and params.get("do_remote_prefill") and isinstance(transfer_id, str):
            self._claims.append(Claim(request.request_id, transfer_id))
            self._claimed.add(request.request_id)

    def _refuse_params(self, params: dict[str, Any], num_tokens: int) -> str:
        """Why P's ``kv_transfer_params`` cannot describe this prompt ("" if they can).

        An early handoff's params (the proxy's, at dispatch: the prefill has
        not run) carry no ``num_tokens`` or ``chunk_tokens``; the loader's
        check that the pushed chunk keys are this prompt's covers both."""
        if not isinstance(params.get("transfer_id"), str):
            return f"kv_transfer_params {params} name no transfer_id"
        if "num_tokens" in params and params["num_tokens"] != num_tokens:
            pushed = params.get("num_tokens")
            return f"the prefiller pushed {pushed} tokens, the prompt has {num_tokens}"
        chunk_tokens = params.get("chunk_tokens", self.config.chunk_tokens)
        if chunk_tokens != self.config.chunk_tokens:
            return (
                f"the prefiller's chunk_tokens {chunk_tokens} != this decoder's "
                f"{self.config.chunk_tokens}"
            )
        return ""

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if self.tier is not None and self.tier.cancel(rid):
            self._release(rid)  # NOTE: scheduled while its lookup was in flight
        hit = self._hits.pop(rid, None)
        if hit is not None and hit.fetch is not None and self.shared is not None:
            self.shared.cancel(hit.fetch)
        if hit is not None:
            if hit.tokens and num_external_tokens > 0:
                start = hit.tokens - num_external_tokens
                first, last = start // self.block_size, hit.tokens // self.block_size
                self._local_loads.append(
                    LocalLoad(
                        rid,
                        first,
                        list(block_ids[first:last]),
                        hit.tokens // self.config.chunk_tokens,
                    )
                )
            else:
                self._release(rid)
        recv = self._receiving.pop(rid, None)
        loads = recv is not None and num_external_tokens > 0
        if rid in self._claimed:
            self._claimed.discard(rid)
            if not loads:
                # NOTE: vLLM calls this for every request it allocates (scheduler.py:1289):
                # one that loads nothing (refused params, a full local hit) lets its
                # claimed transfer go now, not when the request ends
                self._unclaims.append(rid)
        if loads:
            assert recv is not None
            self._attempted.add(rid)
            first = recv.num_local_tokens // self.block_size
            last = -(-(recv.num_local_tokens + num_external_tokens) // self.block_size)
            self._loads.append(
                LoadPlan(
                    rid,
                    recv.transfer_id,
                    first,
                    list(block_ids[first:last]),
                    recv.num_tokens,
                    list(request.prompt_token_ids or [])[: recv.num_tokens],
                    recv.identity,
                    shared=recv.shared,
                )
            )
        params = request.kv_transfer_params or {}
        if rid in self._sending:
            return
        if (self.produce or self.tier is not None) and self.identity(request) is None:
            return  # NOTE: bypassed: nothing kept or pushed; a decoder computes it
        if self.produce and params.get("do_remote_decode"):
            self._track_push(request, params)
        elif self.tier is not None:
            self._track_keep(request)

    def _track_keep(self, request: RequestLike) -> None:
        """Pack the prompt's full chunks into the store as they are computed."""
        tokens = list(request.prompt_token_ids or [])
        full = len(tokens) // self.config.chunk_tokens
        if full:
            counts = [self.config.chunk_tokens // self.block_size] * full
            tokens = tokens[: full * self.config.chunk_tokens]
            self._sending[request.request_id] = _Sending(
                request.request_id, None, None, tokens, counts, self._known_identity(request)
            )

    def _track_push(self, request: RequestLike, params: dict[str, Any]) -> None:
        transfer_id, endpoint = params.get("transfer_id"), params.get("decode_kv_endpoint")
        if not isinstance(transfer_id, str) or not isinstance(endpoint, str):
            logger.warning(
                "request %s: do_remote_decode without transfer_id/decode_kv_endpoint; "
                "nothing will be pushed",
                request.request_id,
            )
            return
        tokens = list(request.prompt_token_ids or [])
        counts = chunk_block_counts(len(tokens), self.config.chunk_tokens, self.block_size)
        self._sending[request.request_id] = _Sending(
            request.request_id, transfer_id, endpoint, tokens, counts, self._known_identity(request)
        )

    def _known_identity(self, request: RequestLike) -> KeyIdentity:
        identity = self.identity(request)
        assert identity is not None, "bypassed requests are never tracked"
        return identity

    # ------------------------------------------------------------ every step
    def build_connector_meta(self, scheduler_output: Any) -> FabricMetadata:
        self.counters.observe("scheduler_wait_seconds", self._waited_s)
        self._waited_s = 0.0
        self._wait_left = self._step_wait_s  # NOTE: the next step's asks
        self._late_holds()
        meta = FabricMetadata(
            loads=self._loads,
            local_loads=self._local_loads,
            releases=self._releases,
            claims=self._claims,
            unclaims=self._unclaims,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._loads, self._local_loads, self._releases = [], [], []
        self._claims, self._unclaims = [], []
        num_scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            send = self._sending.get(new.req_id)
            if send is not None:
                send.block_ids = list(new.block_ids[0])
                computed = new.num_computed_tokens + num_scheduled.get(new.req_id, 0)
                self._emit(send, computed, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            send = self._sending.get(rid)
            if send is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids:
                    send.block_ids = list(new_ids[0])  # preempted: a fresh block list
                else:
                    send.block_ids += new_ids[0]
            computed = cached.num_computed_tokens[i] + num_scheduled.get(rid, 0)
            self._emit(send, computed, meta)
        return meta

    def _emit(self, send: _Sending, computed: int, meta: FabricMetadata) -> None:
        if not send.announced:
            meta.sends.append(
                SendPlan(
                    send.req_id,
                    send.transfer_id,
                    send.endpoint,
                    send.token_ids,
                    send.chunk_blocks,
                    send.identity,
                    hold=self.config.direct_reads is not False and send.transfer_id is not None,
                )
            )
            send.announced = True
        done = min(computed, len(send.token_ids))
        chunk_tokens = self.config.chunk_tokens
        chunk_blocks = chunk_tokens // self.block_size
        while send.next_chunk < len(send.chunk_blocks):
            index = send.next_chunk
            if min((index + 1) * chunk_tokens, len(send.token_ids)) > done:
                return
            start = index * chunk_blocks
            block_ids = send.block_ids[start : start + send.chunk_blocks[index]]
            if len(block_ids) < send.chunk_blocks[index]:
                return  # blocks not allocated yet (cannot happen once computed)
            meta.packs.append(PackChunk(send.req_id, index, block_ids))
            send.next_chunk += 1

    # ------------------------------------------------------------ tables
    def table_sizes(self) -> dict[str, int]:
        """Entries in each per-request table (all 0 when no request is in flight)."""
        peers = self.tier.table_sizes() if self.tier is not None else {}
        if self.shared is not None:
            peers |= self.shared.table_sizes()
        return peers | {
            "scheduler_sending": len(self._sending),
            "scheduler_receiving": len(self._receiving),
            "scheduler_loads": len(self._loads),
            "scheduler_attempted": len(self._attempted),
            "scheduler_hits": len(self._hits),
            "scheduler_identities": len(self._identities),
            "scheduler_local_loads": len(self._local_loads),
            "scheduler_releases": len(self._releases),
            "scheduler_claims": len(self._claims),
            "scheduler_unclaims": len(self._unclaims),
            "scheduler_claimed": len(self._claimed),
        }

    def report_tables(self) -> None:
        """Record the tables' sizes (once per step, after vLLM freed its requests)."""
        self.counters.set_tables("scheduler", self.table_sizes())

    # ------------------------------------------------------------ finish
    def request_finished(self, request: RequestLike) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM keeps the request's blocks (direct reads: its push was
        announced to the workers, which report it sent once no decoder reads
        them any more: ``vllm/v1/core/sched/scheduler.py:2714-2744`` delays
        the free while this says so, :3233-3235 frees at the report), and the
        ``kv_transfer_params`` for the response (prefiller), or None."""
        send = self._sending.pop(request.request_id, None)
        params = self._finished(request, send)
        if send is None or send.transfer_id is None:
            return False, params
        return self.config.direct_reads is not False and send.announced, params

    def _finished(self, request: RequestLike, send: _Sending | None) -> dict[str, Any] | None:
        rid = request.request_id
        # NOTE: a claim not yet shipped (it ended in the step it came): none
        self._claims = [claim for claim in self._claims if claim.req_id != rid]
        self._claimed.discard(rid)
        self._receiving.pop(rid, None)
        self._attempted.discard(rid)
        self._identities.pop(rid, None)
        self._forget_lookup(rid)
        if send is None or send.transfer_id is None:
            return None
        if send.next_chunk < len(send.chunk_blocks):
            logger.warning(
                "request %s finished after %d of %d chunks; the decoder will compute it",
                rid,
                send.next_chunk,
                len(send.chunk_blocks),
            )
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": send.transfer_id,
            "num_tokens": len(send.token_ids),
            "chunk_tokens": self.config.chunk_tokens,
        }
