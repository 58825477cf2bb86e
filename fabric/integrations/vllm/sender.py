"""Prefiller's push thread: reserve on the decoder, WRITE chunks as packed.

The model thread packs a chunk into a store slot at the end of the step
that computed it and hands (request, chunk index, slot) over; this thread
owns every network call, so a slow or dead decoder never blocks a model
step. Failures are logged and counted; the decoder then times out (or is
told by a Cancel) and recomputes. An exception while serving one event or
job fails that job only (counted as ``thread_errors``, its slots released);
the thread keeps serving the others.

A second instance pushes the same chunks into the host's shared store
(:class:`SenderCounters` names its counters, ``prepare`` attaches before the
first Reserve, ``backoff_s`` skips a dead store for a while): on its own
thread, so a slow shared store never delays a push to a decoder.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabric.errors import FabricError, ReservationRefused

if TYPE_CHECKING:
    from fabric.integrations.vllm.counters import FabricCounters
    from fabric.store import ChunkStore
    from fabric.transfer import PeerLink, PendingPush, RemoteReservation, TransferClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SenderCounters:
    """Which counters a sender adds to. ``count_present``: a chunk the
    receiver already had counts as sent (a decoder push) or not (the shared
    store, where only the chunks it lacked are news)."""

    sent: str = "chunks_sent"
    bytes: str = "bytes_sent"
    failures: str = "push_failures"
    count_present: bool = True
    write_seconds: str | None = "chunk_write_seconds"


SHARED_STORE_COUNTERS = SenderCounters(
    sent="shared_store_saved_chunks",
    bytes="shared_store_saved_bytes",
    failures="shared_store_failures",
    count_present=False,
    write_seconds=None,
)


@dataclass
class PushJob:
    req_id: str
    transfer_id: str
    endpoint: str
    keys: list[bytes]
    nbytes: list[int]
    link: PeerLink | None = None
    res: RemoteReservation | None = None
    failed: bool = False
    written: int = 0
    finished: bool = False  # the scheduler is done with the request
    inflight: list[tuple[int, PendingPush, float]] = field(default_factory=list)
    last_heartbeat: float = 0.0

    @property
    def complete(self) -> bool:
        return self.written == len(self.keys) and not self.inflight


class PushSender:
    """Single thread that reserves, writes and tracks every push."""

    def __init__(
        self,
        client: TransferClient,
        store: ChunkStore,
        counters: FabricCounters,
        *,
        lease_ms: int,
        push_timeout_s: float,
        names: SenderCounters = SenderCounters(),
        prepare: Callable[[str], None] | None = None,
        backoff_s: float = 0.0,
        name: str = "fabric-push",
    ) -> None:
        self.client, self.store, self.counters = client, store, counters
        self.lease_ms, self.push_timeout_s = lease_ms, push_timeout_s
        self.names, self.prepare, self.backoff_s = names, prepare, backoff_s
        self._skip_until = 0.0
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        self._jobs: dict[str, PushJob] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- model thread
    def begin(self, job: PushJob) -> None:
        self._events.put(("begin", job))

    def chunk(self, req_id: str, index: int, slot: int) -> None:
        """Chunk ``index`` is packed in ``slot`` (a ref is held; we release it)."""
        self._events.put(("chunk", (req_id, index, slot)))

    def finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._events.put(("finished", rid))

    def fail(self, req_id: str, why: str) -> None:
        """Give the push of ``req_id`` up (a chunk could not be packed)."""
        self._events.put(("fail", (req_id, why)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def thread(self) -> threading.Thread:
        """The push thread (for health: whether it still runs)."""
        return self._thread

    # ---------------------------------------------------------- push thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception:  # NOTE: outside any one job; keep serving
                self.counters.add(thread_errors=1)
                logger.exception("%s: a round failed; continuing", self._thread.name)
                self._stop.wait(0.01)

    def _round(self) -> None:
        busy = any(job.inflight for job in self._jobs.values())
        self._drain(timeout=None if busy else 0.05)
        self._progress()
        if busy:
            time.sleep(5e-5)

    def _drain(self, timeout: float | None) -> None:
        try:
            event = self._events.get(timeout=timeout) if timeout else self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_guarded(*event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _handle_guarded(self, kind: str, payload: object) -> None:
        try:
            self._handle(kind, payload)
        except Exception as exc:
            self.counters.add(thread_errors=1)
            logger.exception("%s: handling %s failed", self._thread.name, kind)
            job = self._job_of(payload)
            if job is not None:
                self._abandon(job, f"{type(exc).__name__}: {exc}")

    def _job_of(self, payload: object) -> PushJob | None:
        if isinstance(payload, PushJob):
            return payload
        rid = payload[0] if isinstance(payload, tuple) else payload
        return self._jobs.get(str(rid))

    def _abandon(self, job: PushJob, why: str) -> None:
        """Fail ``job`` and forget it, releasing every slot it still holds."""
        for entry in list(job.inflight):
            with contextlib.suppress(Exception):
                entry[1].abort()
            try:
                self._drop_inflight(job, entry)
            except Exception:
                logger.exception("%s: releasing slot %d failed", self._thread.name, entry[0])
        job.inflight = []
        try:
            self._fail(job, why)
        except Exception:
            logger.exception("%s: failing %s failed too", self._thread.name, job.req_id)
        self._jobs.pop(job.req_id, None)

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "begin":
            assert isinstance(payload, PushJob)
            self._jobs[payload.req_id] = payload
            self._reserve(payload)
        elif kind == "chunk":
            assert isinstance(payload, tuple)
            self._write(*payload)
        elif kind == "finished":
            job = self._jobs.get(str(payload))
            if job is not None:
                job.finished = True
                self._maybe_drop(job)
        elif kind == "fail":
            assert isinstance(payload, tuple)
            job = self._jobs.get(payload[0])
            if job is not None:
                self._fail(job, payload[1])
                self._maybe_drop(job)

    def _reserve(self, job: PushJob) -> None:
        if time.monotonic() < self._skip_until:
            job.failed = True  # the receiver failed recently: skip, quietly
            self._maybe_drop(job)
            return
        try:
            if self.prepare is not None:
                self.prepare(job.endpoint)
            job.link = self.client.connect(job.endpoint)
            job.res = job.link.reserve(job.transfer_id, job.keys, job.nbytes, self.lease_ms)
            job.last_heartbeat = time.monotonic()
        except FabricError as exc:
            self._skip_until = time.monotonic() + self.backoff_s
            if self.backoff_s and not isinstance(exc, ReservationRefused):
                # NOTE: a shared store may come back (restarted) with a new
                # data plane: handshake again next time.
                self.client.disconnect(job.endpoint)
            self._fail(job, f"reserve on {job.endpoint} failed: {exc}")

    def _write(self, req_id: str, index: int, slot: int) -> None:
        job = self._jobs.get(req_id)
        if job is None or job.failed or job.link is None or job.res is None:
            self.store.release_slots([slot])
            return
        try:
            push = job.link.write(job.res, [index], [slot])
        except Exception as exc:
            self.store.release_slots([slot])  # NOTE: the one release of this slot
            if not isinstance(exc, FabricError):
                raise
            self._fail(job, f"write of chunk {index} failed: {exc}")
            return
        job.written += 1
        job.inflight.append((slot, push, time.monotonic()))

    def _progress(self) -> None:
        now = time.monotonic()
        for job in list(self._jobs.values()):
            try:
                self._progress_job(job, now)
            except Exception as exc:
                self.counters.add(thread_errors=1)
                logger.exception("%s: progressing %s failed", self._thread.name, job.req_id)
                self._abandon(job, f"{type(exc).__name__}: {exc}")

    def _progress_job(self, job: PushJob, now: float) -> None:
        for entry in list(job.inflight):
            _, push, started = entry
            try:
                done = push.done()
            except FabricError as exc:
                self._drop_inflight(job, entry)
                self._fail(job, f"write failed: {exc}")
                continue
            if done:
                self._drop_inflight(job, entry)
                self._count_sent(push.nbytes, now - started)
            elif now - started > self.push_timeout_s:
                push.abort()  # NOTE: no more bytes from it; the receiver quarantines the rest
                self._drop_inflight(job, entry)
                self._fail(job, f"write not done in {self.push_timeout_s} s")
        self._heartbeat(job, now)
        self._maybe_drop(job)

    def _drop_inflight(self, job: PushJob, entry: tuple[int, PendingPush, float]) -> None:
        """Forget one posted write and release its slot: once, whatever raises."""
        job.inflight.remove(entry)
        self.store.release_slots([entry[0]])

    def _count_sent(self, nbytes: int, seconds: float) -> None:
        names = self.names
        if nbytes or names.count_present:
            self.counters.add(**{names.sent: 1, names.bytes: nbytes})
        if names.write_seconds is not None:
            self.counters.observe(names.write_seconds, seconds)

    def _heartbeat(self, job: PushJob, now: float) -> None:
        # NOTE: a long prefill (tens of seconds on a CPU) must not let the
        # decoder's reservation expire while chunks are still to come.
        if job.failed or job.complete or job.link is None:
            return
        if now - job.last_heartbeat > self.lease_ms / 3000:
            job.last_heartbeat = now
            try:
                job.link.heartbeat(job.transfer_id, self.lease_ms)
            except FabricError as exc:
                self._fail(job, f"heartbeat failed: {exc}")

    def _maybe_drop(self, job: PushJob) -> None:
        if job.inflight:
            return
        if job.complete or job.failed:
            self._jobs.pop(job.req_id, None)
        elif job.finished:
            self._fail(job, "request finished before every chunk was computed")
            self._jobs.pop(job.req_id, None)

    def _fail(self, job: PushJob, why: str) -> None:
        if job.failed:
            return
        job.failed = True
        self.counters.add(**{self.names.failures: 1})
        logger.warning("fabric push %s (request %s): %s", job.transfer_id, job.req_id, why)
        if job.link is not None and job.res is not None:
            try:
                job.link.cancel(job.transfer_id)
            except Exception as exc:  # NOTE: a failed cancel only delays the decoder's fallback
                logger.info("cancel of %s failed too: %s", job.transfer_id, exc)
