"""Decoder's load thread: unpack pushed chunks into vLLM's blocks as they land.

Each ``LoadPlan`` names a transfer (reserved on this engine's store by the
prefiller) and the vLLM blocks to fill. The thread unpacks every chunk as
soon as the transfer server verified it (or at once when the store already
held it), and reports the request finished. Every wait is bounded: a
transfer never heard of fails after ``unknown_transfer_grace_s``, a known
one after ``load_timeout_s``; a checksum failure, an expired lease, or a
push whose Reserve this engine refused (its store was full: no sender
retries it, :meth:`TransferServer.refusal`) fails at once. A failed load is
logged, counted, and reported to vLLM, which recomputes the prompt
(``kv_load_failure_policy: recompute``).

A decoder admitted at dispatch (the proxy sent it the request with the
prefill's) waits while the prefiller still computes; the proxy says how the
prefill stands (``PrefillState``, kept by the server: :meth:`TransferServer.
prefill_note`), and the bounds follow it::

    no word (sequential flow)   bounds counted from the load's start
    running, said again in time no bound: the prefiller has it and computes
    running, word ran out       fail now (the prefiller or the proxy is gone)
    done                        bounds counted from when the prefill ended
    failed                      fail now: vLLM recomputes at once (unless
                                every chunk is in: what came is loaded)

The thread sleeps until the server reports a change (a chunk landed,
verified or failed, a Reserve, a prefill note) or new work comes, at most
``IDLE_WAIT_S``: no fixed polling. A wake steps only the loads whose
transfer changed; every ``IDLE_WAIT_S`` all of them are stepped (bounds).
A waiting load heartbeats its reservation every ``HEARTBEAT_S`` (a quarter
of its lease if that is shorter).

Before a byte is used the loader checks that the transfer is this prompt's:
the reservation's keys must equal the keys of the plan's own token ids and
identity (so a prefiller with another tokenizer, chat template, chunk size,
layout or weights, and a foreign or truncated Reserve under the transfer's
id, are refused, counted as ``refused_transfers`` and recomputed). An
exception while serving a load fails that load only (counted as
``thread_errors``); the thread keeps serving the others.

A fetch from the host's shared store (``LoadPlan.shared``) is the same kind
of transfer, pushed by the shared store instead of a prefiller; it is
counted as ``shared_store_*`` rather than as a PD load.

Every load ends, and is reported to vLLM exactly once (``take_results``),
whichever way: loaded, failed (checksum, lease, foreign keys, timeout, an
exception), or ended by its request (``finished``: vLLM names a request
aborted while it waits for its KV in the ``finished_req_ids`` of the next
step, ``vllm/v1/core/sched/scheduler.py:2736`` in ``_free_request``,
shipped at :1514 and handed to the worker at
``vllm/v1/worker/kv_connector_model_runner_mixin.py:94-96``; the scheduler
keeps that request's blocks until the load is reported, ``scheduler.py``
:2702-2710 in ``finish_requests`` and :3229-3231). A load so ended is
released at once (no more bytes are unpacked into its blocks) and reported
failed, which vLLM ignores for a finished request (``scheduler.py``
:3341-3354).
Each end releases the transfer's reservation (``TransferServer.release``);
a transfer whose Reserve arrives after its load ended is refused (within
``ABANDONED_LINGER_S`` of the end, :mod:`fabric.transfer.server`), so it
takes no slot of the store (one that a prefiller with a backlog pushes past
``unknown_transfer_grace_s`` would otherwise hold its slots for its lease).

A request queued in vLLM waits there, blocks not allocated, until the
scheduler can fit it; under KV pressure that is longer than a lease, and its
pushed transfer expired before its load began (in the sequential flow P
pushes as soon as it computed, and D may queue a backlog). So the scheduler
claims the transfer on the request's arrival (``on_new_request``, called by
``Scheduler.add_request``, ``vllm/v1/core/sched/scheduler.py:2640``) and the
worker gets a ``Claim``: while the request waits, this thread heartbeats the
transfer's reservation (every ``HEARTBEAT_S``) like a load's once the push
landed complete and verified (a push in flight its sender heartbeats; one
whose sender died or whose chunk failed ends with its lease), for at most
``waiting_hold_s`` (counted as ``claims_expired``). The claim ends when the
load starts (which takes the transfer over), when vLLM allocates the
request without a load (refused params, a full local hit: ``unclaims``,
released), or when the request ends first (``finished``: released, and a
Reserve that comes later is refused). A claim holds store slots, never vLLM blocks:
a store full of claimed transfers refuses the next pushes for capacity (the
prefiller drops them, the decoder computes those prompts), and drains as
the queue does.

``table_sizes`` counts what is still tracked: 0 once every request ended.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabric.errors import ChecksumMismatch
from fabric.integrations.vllm.metadata import Claim, LoadPlan
from fabric.kv import chunk_keys, unpack
from fabric.kv.layerwise import LayerwiseUnpack, supported
from fabric.kv.spans import ChunkSpan, chunk_block_counts, chunk_spans
from fabric.threads import thread as named_thread

if TYPE_CHECKING:
    import torch

    from fabric.integrations.vllm.counters import FabricCounters
    from fabric.kv import KVLayout
    from fabric.store import ChunkStore
    from fabric.store.records import Reservation
    from fabric.transfer import TransferServer
    from fabric.transfer.progress import PrefillNote, RequestProgress

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # the longest the thread sleeps with loads active (bounds are checked then)
HEARTBEAT_S = 1.0  # how often a waiting load extends its reservation's lease


def unpack_slot(
    store: ChunkStore,
    slot: int,
    kv_caches: list[torch.Tensor],
    layout: KVLayout,
    span: ChunkSpan,
    key: bytes,
) -> None:
    """Unpack the chunk ``key`` in ``slot`` into ``span``'s targets, verifying
    its checksum in the same pass; ChecksumMismatch when it does not, or when
    the slot holds another key (the targets then hold garbage: the caller has
    vLLM recompute them)."""
    digest = store.slot_digest(slot, key)
    if digest is None:
        raise ChecksumMismatch(f"slot {slot} holds no verified chunk {key.hex()}")
    unpack(
        store.pool.slot_view(slot),
        kv_caches,
        layout,
        list(span.targets),
        chunk_blocks=span.chunk_blocks,
        first=span.first,
        checksum=digest.checksum,
        nbytes=digest.nbytes,
        checksum_kind=store.pool.checksum_name,
    )  # NOTE: on a GPU it returns once its copies ended: before the load is reported


@dataclass
class _Load:
    plan: LoadPlan
    started: float
    chunks: dict[int, ChunkSpan]  # the chunks it unpacks, by index
    keys: tuple[bytes, ...]  # what the transfer must carry
    done: set[int] = field(default_factory=set)
    beat_at: float = 0.0  # when it last extended its reservation's lease
    stepped: bool = False  # stepped once since it started (a new load always is)
    refused: str | None = None  # why its push was refused, seen while it was claimed
    # chunks being streamed: the slot each one's bytes are read from, and its unpack
    streams: dict[int, tuple[int, LayerwiseUnpack]] = field(default_factory=dict)


@dataclass
class _Claimed:
    transfer_id: str
    at: float  # when this thread took the claim (a step after the request arrived)
    refused: str | None = None  # why its Reserve was refused here (kept for its load)


@dataclass(frozen=True)
class _Unclaim:
    req_id: str


class Loader:
    """Single thread that completes LoadPlans and reports them."""

    def __init__(
        self,
        server: TransferServer,
        store: ChunkStore,
        layout: KVLayout,
        kv_caches: list[torch.Tensor],
        counters: FabricCounters,
        *,
        chunk_tokens: int,
        block_size: int,
        load_timeout_s: float,
        unknown_grace_s: float,
        lease_ms: int,
        pack_threads: int,
        waiting_hold_s: float = 600.0,
    ) -> None:
        self.server, self.store, self.layout, self.kv_caches = server, store, layout, kv_caches
        self.counters = counters
        self.chunk_tokens, self.block_size = chunk_tokens, block_size
        self.load_timeout_s, self.unknown_grace_s = load_timeout_s, unknown_grace_s
        self.lease_ms, self.pack_threads = lease_ms, pack_threads
        self.waiting_hold_s = waiting_hold_s
        self._plans: queue.Queue[LoadPlan | Claim | _Unclaim] = queue.Queue()
        self._active: dict[str, _Load] = {}
        self._claims: dict[str, _Claimed] = {}  # request -> the transfer it will load
        self._claims_kept_at = 0.0
        self._lock = threading.Lock()
        self._results = threading.Condition(self._lock)  # notified when a load ends
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._open: set[str] = set()  # submitted, not yet reported (take_results)
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._swept_at = 0.0  # when every active load was last stepped
        # NOTE: streamed chunks are hashed with xxh3 as they are unpacked: host pools only
        self._streaming = bool(kv_caches) and supported(kv_caches) and store.pool.is_host
        self._thread = named_thread(self._run, name="fabric-load")
        self._thread.start()

    def submit(self, plan: LoadPlan) -> None:
        with self._lock:
            self._open.add(plan.req_id)
        self._plans.put(plan)
        self.server.wake()

    def claim(self, claim: Claim) -> None:
        """Keep what is pushed for ``claim.transfer_id`` while its request
        waits for blocks (see the module docstring)."""
        self._plans.put(claim)

    def unclaim(self, req_id: str) -> None:
        """vLLM allocated ``req_id`` without a load: release its claimed
        transfer (nothing when its claim already ended)."""
        self._plans.put(_Unclaim(req_id))

    def finished(self, req_ids: set[str]) -> None:
        """vLLM is done with these requests (``finished_req_ids``): a load
        still active for one is ended (released, reported failed)."""
        for rid in req_ids:
            self._ended.put(rid)
        if req_ids:
            self.server.wake()

    def table_sizes(self) -> dict[str, int]:
        """Loads queued, active, and finished but not yet reported (name -> entries)."""
        with self._lock:
            finished, failed = len(self._finished), len(self._failed)
            opened = len(self._open)
        return {
            "loader_plans": self._plans.qsize() + self._ended.qsize(),
            "loader_active": len(self._active),
            "loader_claims": len(self._claims),
            "loader_finished": finished,
            "loader_open": opened,
            "loader_failed": failed,
        }

    @property
    def busy(self) -> bool:
        """Loads planned or active (``wait_results`` waits for them)."""
        return bool(self._active) or not self._plans.empty()

    def wait_results(self, timeout: float) -> None:
        """Until a load ended (its result waits for ``take_results``), or
        ``timeout`` s passed; at once when none is planned or active."""
        if not self._active and self._plans.empty():
            return
        with self._results:
            if not self._finished:
                self._results.wait(timeout)

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; failed ⊆ finished."""
        with self._lock:
            finished, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
            self._open -= finished
        return finished, failed

    def loading(self) -> set[str]:
        """Requests with a load submitted and not yet reported (any thread)."""
        with self._lock:
            return set(self._open)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def thread(self) -> threading.Thread:
        """The load thread (for health: whether it still runs)."""
        return self._thread

    # ---------------------------------------------------------- load thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception:  # NOTE: outside any one load; keep serving
                self.counters.add(thread_errors=1)
                logger.exception("fabric load thread: a round failed; continuing")
                self._stop.wait(0.01)

    def _round(self) -> None:
        seen = self.server.events()  # NOTE: before any look: a change during the round wakes
        dirty = self.server.take_dirty()
        self._take_plans(block=not self._active)
        self._take_ended()  # NOTE: after the plans: a plan always comes before its end
        now = time.monotonic()
        if self._claims and now - self._claims_kept_at >= min(HEARTBEAT_S, self.lease_ms / 4000):
            self._keep_claims(now)
        if now - self._swept_at >= IDLE_WAIT_S:
            dirty, self._swept_at = None, now
        for load in list(self._active.values()):
            if dirty is not None and load.stepped and load.plan.transfer_id not in dirty:
                continue  # NOTE: nothing of its transfer changed; the next sweep looks
            load.stepped = True
            try:
                self._step(load)
            except Exception as exc:  # NOTE: fails this load only; the thread goes on
                self.counters.add(thread_errors=1)
                logger.exception("fabric load thread: serving %s failed", load.plan.req_id)
                self._abandon(load, f"{type(exc).__name__}: {exc}")
        if self._active:
            self.server.wait_change(seen, IDLE_WAIT_S)

    def _abandon(self, load: _Load, why: str) -> None:
        """Fail ``load`` even if its normal finish raises too."""
        self._active.pop(load.plan.req_id, None)
        try:
            self._finish(load, ok=False, why=why)
        except Exception:
            logger.exception("fabric load thread: finishing %s failed", load.plan.req_id)
            with self._lock:
                self._finished.add(load.plan.req_id)
                self._failed.add(load.plan.req_id)
                self._results.notify_all()

    def _take_ended(self) -> None:
        """End the loads whose requests vLLM named finished.

        NOTE: a plan is always queued before its end (the worker submits it
        in ``start_load``, before ``get_results`` of the same step names any
        request finished, on the same thread), but both may be queued after
        this round took the plans: an end that finds no
        active load takes the plans queued since, then looks again. Still
        none: the load was already reported (or never planned), and the
        end has nothing to do.
        """
        while True:
            try:
                rid = self._ended.get_nowait()
            except queue.Empty:
                return
            if rid not in self._active:
                self._take_plans(block=False)
            self._release_claim(rid)  # NOTE: ended while it waited for blocks
            load = self._active.get(rid)
            if load is not None:
                self._finish(load, ok=False, ended=True)

    def _take(self, plan: LoadPlan | Claim | _Unclaim) -> None:
        if isinstance(plan, Claim):
            self._claims[plan.req_id] = _Claimed(plan.transfer_id, time.monotonic())
            return
        if isinstance(plan, _Unclaim):
            self._release_claim(plan.req_id)
            return
        # NOTE: a load holds the transfer now (and learns a refusal seen meanwhile)
        claimed = self._claims.pop(plan.req_id, None)
        self._start(plan, None if claimed is None else claimed.refused)

    def _release_claim(self, rid: str) -> None:
        """End ``rid``'s claim (if any) without a load: release its transfer."""
        claimed = self._claims.pop(rid, None)
        if claimed is not None:
            self.server.release(claimed.transfer_id)

    def _take_plans(self, *, block: bool) -> None:
        try:
            plan = self._plans.get(timeout=0.05) if block else self._plans.get_nowait()
        except queue.Empty:
            return
        while True:
            self._take(plan)
            try:
                plan = self._plans.get_nowait()
            except queue.Empty:
                return

    def _keep_claims(self, now: float) -> None:
        """Heartbeat the reservation of every claimed transfer that landed
        complete and verified; note a refusal of its Reserve for its load (the
        request may wait longer than the server remembers refusals); give up
        on claims older than ``waiting_hold_s``."""
        self._claims_kept_at = now
        for rid, claimed in list(self._claims.items()):
            if now - claimed.at > self.waiting_hold_s:
                del self._claims[rid]
                self.counters.add(claims_expired=1)
                logger.info(
                    "fabric: request %s waited %.0f s for blocks; its transfer %s is no "
                    "longer kept (waiting_hold_s)",
                    rid,
                    now - claimed.at,
                    claimed.transfer_id,
                )
                continue
            tid = claimed.transfer_id
            prog = self.server.progress(tid)
            if prog is None:
                # NOTE: the request may wait longer than the server remembers
                claimed.refused = claimed.refused or self.server.refusal(tid)
            elif prog.complete and not (prog.failed or prog.expired):
                # NOTE: only a complete push: one in flight its sender heartbeats
                # itself, one whose sender died or that failed ends with its lease
                self.store.heartbeat(tid, self.lease_ms)

    def _start(self, plan: LoadPlan, refused: str | None = None) -> None:
        """Make ``plan`` active; a plan that cannot even be mapped fails at once."""
        try:
            keys = chunk_keys(
                plan.token_ids,
                self.chunk_tokens,
                self.layout.fingerprint(),
                identity=plan.identity,
            )
            load = _Load(plan, time.monotonic(), self._chunk_map(plan), tuple(keys))
            load.refused = refused
        except Exception as exc:
            self.counters.add(thread_errors=1)
            logger.exception("fabric load thread: cannot start the load of %s", plan.req_id)
            self._abandon(_Load(plan, time.monotonic(), {}, ()), f"{type(exc).__name__}: {exc}")
            return
        self._active[plan.req_id] = load

    def _chunk_map(self, plan: LoadPlan) -> dict[int, ChunkSpan]:
        """The spans of the chunks the plan touches, by chunk index."""
        counts = chunk_block_counts(plan.num_tokens, self.chunk_tokens, self.block_size)
        spans = chunk_spans(
            plan.first_block, plan.block_ids, counts, self.chunk_tokens // self.block_size
        )
        return {span.index: span for span in spans}

    def _step(self, load: _Load) -> None:
        tid = load.plan.transfer_id
        note = self.server.prefill_note(tid)
        failed = (
            f"the prefill of {tid} failed: {note.reason}" if note and note.state == "failed" else ""
        )
        prog = self.server.progress(tid)
        res = self.store.reservation(tid)
        now = time.monotonic()
        elapsed = now - load.started
        if (prog is None or res is None) and failed:
            self._finish(load, ok=False, why=failed)
            return
        if prog is None or res is None:
            refused = load.refused or self.server.refusal(tid)
            if refused is not None:  # NOTE: no sender retries a refused push
                self._finish(load, ok=False, why=f"the push of {tid} was refused here: {refused}")
                return
            overdue = self._overdue(load, note, now, self.unknown_grace_s)
            if overdue:
                why = (
                    overdue
                    if isinstance(overdue, str)
                    else f"no transfer {tid} reached this engine"
                )
                self._finish(load, ok=False, why=why)
            return
        if res.keys != load.keys:  # NOTE: every step: a Reserve anew must match too
            self.counters.add(refused_transfers=1)
            self._finish(load, ok=False, why=self._foreign(load, res.keys))
            return
        if not load.done and now - load.beat_at >= min(HEARTBEAT_S, self.lease_ms / 4000):
            self.store.heartbeat(tid, self.lease_ms)  # we hold it while we wait
            load.beat_at = now
        if prog.failed or prog.expired:
            self._finish(load, ok=False, why=f"transfer {tid} failed (checksum or lease)")
            return
        ready = [i for i in load.chunks if i not in load.done and self._available(i, prog, res)]
        sealed = sum(1 for i in load.streams if i in prog.sealed)  # NOTE: all in, hashed below
        if failed and len(load.done) + len(ready) + sealed < len(load.chunks):
            # NOTE: what came is kept only when it is all of it
            self._finish(load, ok=False, why=failed)
            return
        for index in ready:
            try:
                self._unpack(load, index, res.slots[index], fetched=not res.already_present[index])
            except ChecksumMismatch as exc:
                self.counters.add(corrupt_chunks=1)
                self._finish(load, ok=False, why=f"chunk {index} of {tid} at use: {exc}")
                self.store.discard(load.keys[index])  # NOTE: once the release above let go
                return
        if self._streaming and not self._stream(load, prog, res):
            return
        if len(load.done) == len(load.chunks):
            self._finish(load, ok=True)
        elif overdue := self._overdue(load, note, now, self.load_timeout_s):
            missing = sorted(set(load.chunks) - load.done)
            why = (
                f"chunk(s) {missing} of {tid} not in after {elapsed:.1f} s "
                f"(landed {sorted(prog.landed)}, verified {sorted(prog.filled)})"
            )
            self._finish(load, ok=False, why=why if overdue is True else f"{overdue}; {why}")

    def _stream(self, load: _Load, prog: RequestProgress, res: Reservation) -> bool:
        """Unpack the layers of chunks whose parts landed (a prefiller writes
        each layer group as it packs it, :class:`~fabric.transfer.protocol.
        WritePart`), hashing them in the same pass; a chunk whose WriteDone
        came is finished and indexed with that digest (the server's verifier
        leaves it to us: :meth:`TransferServer.stream`). Its blocks are read
        by vLLM only once the whole load is reported, so layers unpacked
        before the chunk verified are never used unverified: a digest that
        does not match has the slot verified whole and, if it holds the
        chunk, the chunk unpacked again with verification; if not, the load
        fails (recomputed). False when the load ended."""
        tid = load.plan.transfer_id
        for index, span in load.chunks.items():
            if index in load.done or res.already_present[index]:
                continue
            stream = load.streams.get(index)
            layers = min(prog.parts.get(index, 0), self.layout.num_layers)
            if stream is None:
                if (
                    not layers
                    or res.nbytes[index] < self.layout.chunk_nbytes(span.chunk_blocks)
                    or not self.server.stream(tid, index)
                ):
                    continue  # NOTE: a short reservation fails as the verifier finds it
                slot = res.slots[index]
                stream = (
                    slot,
                    LayerwiseUnpack(
                        self.store.pool.slot_view(slot),
                        self.kv_caches,
                        self.layout,
                        list(span.targets),
                        chunk_blocks=span.chunk_blocks,
                        first=span.first,
                        nbytes=res.nbytes[index],
                    ),
                )
                load.streams[index] = stream
            slot, part = stream
            sealed = prog.sealed.get(index)
            if sealed is None:
                part.unpack_layers(layers)
                continue
            checksum, _, start = sealed
            read = part.bytes_read  # NOTE: before the WriteDone came
            digest = part.finish()
            del load.streams[index]
            # NOTE: a last write that rewrote bytes unpacked before it came (the
            # chunk went whole: a slot given back, a route loaded again, faults)
            # leaves the digest saying nothing of what the slot holds now
            trusted = digest == checksum and start >= read
            hashed = (slot, digest)  # NOTE: the slot it read, whatever the reservation says now
            if trusted and self.server.fill_streamed(tid, index, sealed, hashed):
                self.counters.add(chunks_streamed=1)
                self._loaded(load, index)
                continue
            why = f"chunk {index} of {tid}: its bytes did not verify (checksum or lease)"
            if not trusted:
                self.counters.add(streams_redone=1)
                logger.info(
                    "request %s chunk %d: streamed bytes %s; verified and unpacked again whole",
                    load.plan.req_id,
                    index,
                    "did not verify" if digest != checksum else "were written again",
                )
                if self.server.fill_streamed(tid, index, sealed, None):
                    fresh = self.store.reservation(tid)
                    try:
                        self._unpack(
                            load, index, fresh.slots[index] if fresh else slot, fetched=True
                        )
                        continue
                    except ChecksumMismatch as exc:
                        why = f"chunk {index} of {tid} at use: {exc}"
            self.counters.add(corrupt_chunks=1)
            self._finish(load, ok=False, why=why)
            return False
        return True

    @staticmethod
    def _overdue(load: _Load, note: PrefillNote | None, now: float, bound: float) -> bool | str:
        """Whether ``load`` waited past ``bound`` (see the module docstring):
        False, True, or why (a ``running`` word that ran out)."""
        if note is None:
            return now - load.started > bound
        if note.state == "running":
            if now <= note.until:
                return False
            return (
                f"no word of the prefill of {load.plan.transfer_id} for "
                f"{now - note.at:.1f} s (its prefiller or the proxy is gone)"
            )
        return now - max(load.started, note.at) > bound

    def _foreign(self, load: _Load, keys: tuple[bytes, ...]) -> str:
        """Why the transfer's ``keys`` are not this prompt's ("" when they are)."""
        if len(keys) != len(load.keys):
            return (
                f"transfer {load.plan.transfer_id} carries {len(keys)} chunk keys, this "
                f"prompt of {load.plan.num_tokens} tokens has {len(load.keys)}: refused"
            )
        for index, (theirs, mine) in enumerate(zip(keys, load.keys, strict=True)):
            if theirs != mine:
                return (
                    f"transfer {load.plan.transfer_id}: chunk {index}'s key is not this "
                    "prompt's (other tokens, chunk size, layout, weights or identity): refused"
                )
        return ""

    @staticmethod
    def _available(index: int, prog: object, res: object) -> bool:
        return index in prog.filled or res.already_present[index]  # type: ignore[attr-defined]

    def _unpack(self, load: _Load, index: int, slot: int, *, fetched: bool) -> None:
        """Unpack chunk ``index``, verifying its checksum in the same pass
        (ChecksumMismatch: the target blocks hold garbage; vLLM recomputes)."""
        span = load.chunks[index]
        unpack_slot(self.store, slot, self.kv_caches, self.layout, span, load.keys[index])
        self._loaded(load, index, fetched=fetched)

    def _loaded(self, load: _Load, index: int, *, fetched: bool = True) -> None:
        span = load.chunks[index]
        load.done.add(index)
        self.counters.add(chunks_loaded=1, bytes_loaded=self.layout.chunk_nbytes(len(span.targets)))
        if load.plan.shared and fetched:
            self.counters.add(shared_store_loaded_chunks=1)

    def _finish(self, load: _Load, *, ok: bool, why: str = "", ended: bool = False) -> None:
        """End ``load``: release its transfer, count it, report it (even if
        the first two raise). ``ended``: its request ended first."""
        rid = load.plan.req_id
        self._active.pop(rid, None)
        try:
            self.server.release(load.plan.transfer_id)
            self._count(load, ok=ok, why=why, ended=ended)
        finally:
            with self._lock:
                self._finished.add(rid)
                if not ok:
                    self._failed.add(rid)
                self._results.notify_all()

    def _count(self, load: _Load, *, ok: bool, why: str, ended: bool) -> None:
        rid, shared = load.plan.req_id, load.plan.shared
        if ended:
            self.counters.add(loads_ended=1)
            logger.info("fabric load for request %s: the request ended first", rid)
        elif ok:
            tokens = load.plan.num_tokens - load.plan.first_block * self.block_size
            if shared:
                self.counters.add(shared_store_loaded_tokens=tokens)
            else:
                self.counters.add(loads_ok=1, tokens_loaded=load.plan.num_tokens)
            self.counters.observe("load_seconds", time.monotonic() - load.started)
        else:
            self.counters.add(**{"shared_store_failures" if shared else "load_failures": 1})
            logger.warning(
                "fabric load for request %s failed: %s; vLLM recomputes the prompt", rid, why
            )
