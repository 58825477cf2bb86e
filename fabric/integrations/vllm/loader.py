"""Decoder's load thread: unpack pushed chunks into vLLM's blocks as they land.

Each ``LoadPlan`` names a transfer (reserved on this engine's store by the
prefiller) and the vLLM blocks to fill. The thread unpacks every chunk as
soon as the transfer server verified it (or at once when the store already
held it), and reports the request finished. Every wait is bounded: a
transfer never heard of fails after ``unknown_transfer_grace_s``, a known
one after ``load_timeout_s``; a checksum failure or an expired lease fails
at once. A failed load is logged, counted, and reported to vLLM, which
recomputes the prompt (``kv_load_failure_policy: recompute``).

A fetch from the host's shared store (``LoadPlan.shared``) is the same kind
of transfer, pushed by the shared store instead of a prefiller; it is
counted as ``shared_store_*`` rather than as a PD load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.kv import unpack

if TYPE_CHECKING:
    import torch

    from fabric.integrations.vllm.counters import FabricCounters
    from fabric.integrations.vllm.metadata import LoadPlan
    from fabric.kv import KVLayout
    from fabric.store import ChunkStore
    from fabric.transfer import TransferServer

logger = logging.getLogger(__name__)


@dataclass
class _Load:
    plan: LoadPlan
    started: float
    chunks: dict[int, tuple[int, int, list[int]]]  # index -> (first, count, block ids)
    done: set[int] = field(default_factory=set)


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
    ) -> None:
        self.server, self.store, self.layout, self.kv_caches = server, store, layout, kv_caches
        self.counters = counters
        self.chunk_tokens, self.block_size = chunk_tokens, block_size
        self.load_timeout_s, self.unknown_grace_s = load_timeout_s, unknown_grace_s
        self.lease_ms, self.pack_threads = lease_ms, pack_threads
        self._plans: queue.Queue[LoadPlan] = queue.Queue()
        self._active: dict[str, _Load] = {}
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fabric-load", daemon=True)
        self._thread.start()

    def submit(self, plan: LoadPlan) -> None:
        self._plans.put(plan)

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; failed ⊆ finished."""
        with self._lock:
            finished, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
        return finished, failed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---------------------------------------------------------- load thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._take_plans(block=not self._active)
            for load in list(self._active.values()):
                self._step(load)
            if self._active:
                # Woken by the server on every landed/verified chunk.
                rid = next(iter(self._active.values())).plan.transfer_id
                self.server.wait_until(rid, lambda p: False, 0.002)

    def _take_plans(self, *, block: bool) -> None:
        try:
            plan = self._plans.get(timeout=0.05) if block else self._plans.get_nowait()
        except queue.Empty:
            return
        while True:
            self._active[plan.req_id] = _Load(plan, time.monotonic(), self._chunk_map(plan))
            try:
                plan = self._plans.get_nowait()
            except queue.Empty:
                return

    def _chunk_map(self, plan: LoadPlan) -> dict[int, tuple[int, int, list[int]]]:
        """For each chunk touching the plan: (first block in chunk, count, targets)."""
        chunk_blocks = self.chunk_tokens // self.block_size
        counts = chunk_block_counts(plan.num_tokens, self.chunk_tokens, self.block_size)
        out: dict[int, tuple[int, int, list[int]]] = {}
        for offset, block_id in enumerate(plan.block_ids):
            prompt_block = plan.first_block + offset
            index, pos = divmod(prompt_block, chunk_blocks)
            if index >= len(counts) or pos >= counts[index]:
                break
            first, count, targets = out.get(index, (pos, 0, []))
            out[index] = (first, count + 1, [*targets, block_id])
        return out

    def _step(self, load: _Load) -> None:
        tid = load.plan.transfer_id
        prog = self.server.progress(tid)
        res = self.store.reservation(tid)
        elapsed = time.monotonic() - load.started
        if prog is None or res is None:
            if elapsed > self.unknown_grace_s:
                self._finish(load, ok=False, why=f"no transfer {tid} reached this engine")
            return
        if not load.done:
            self.store.heartbeat(tid, self.lease_ms)  # we hold it while we wait
        if prog.failed or prog.expired:
            self._finish(load, ok=False, why=f"transfer {tid} failed (checksum or lease)")
            return
        ready = [i for i in load.chunks if i not in load.done and self._available(i, prog, res)]
        for index in ready:
            self._unpack(load, index, res.slots[index], fetched=not res.already_present[index])
        if len(load.done) == len(load.chunks):
            self._finish(load, ok=True)
        elif elapsed > self.load_timeout_s:
            missing = sorted(set(load.chunks) - load.done)
            why = (
                f"chunk(s) {missing} of {tid} not in after {elapsed:.1f} s "
                f"(landed {sorted(prog.landed)}, verified {sorted(prog.filled)})"
            )
            self._finish(load, ok=False, why=why)

    @staticmethod
    def _available(index: int, prog: object, res: object) -> bool:
        return index in prog.filled or res.already_present[index]  # type: ignore[attr-defined]

    def _unpack(self, load: _Load, index: int, slot: int, *, fetched: bool) -> None:
        first, count, targets = load.chunks[index]
        counts = chunk_block_counts(load.plan.num_tokens, self.chunk_tokens, self.block_size)
        unpack(
            self.store.pool.slot_view(slot),
            self.kv_caches,
            self.layout,
            targets,
            chunk_blocks=counts[index],
            first=first,
            num_threads=self.pack_threads,
        )
        load.done.add(index)
        self.counters.add(chunks_loaded=1, bytes_loaded=self.layout.chunk_nbytes(count))
        if load.plan.shared and fetched:
            self.counters.add(shared_store_loaded_chunks=1)

    def _finish(self, load: _Load, *, ok: bool, why: str = "") -> None:
        rid, tid = load.plan.req_id, load.plan.transfer_id
        self._active.pop(rid, None)
        self.server.release(tid)
        shared = load.plan.shared
        if ok:
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
        with self._lock:
            self._finished.add(rid)
            if not ok:
                self._failed.add(rid)
