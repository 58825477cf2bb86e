"""Prefiller's push thread: reserve on the decoder, WRITE chunks as packed.

The model thread packs a chunk into a store slot at the end of the step
that computed it and hands (request, chunk index, slot) over; this thread
owns every network call, so a slow or dead decoder never blocks a model
step. Failures are logged and counted; the decoder then times out (or is
told by a Cancel) and recomputes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabric.errors import FabricError

if TYPE_CHECKING:
    from fabric.integrations.vllm.counters import FabricCounters
    from fabric.store import ChunkStore
    from fabric.transfer import PeerLink, PendingPush, RemoteReservation, TransferClient

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.client, self.store, self.counters = client, store, counters
        self.lease_ms, self.push_timeout_s = lease_ms, push_timeout_s
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        self._jobs: dict[str, PushJob] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fabric-push", daemon=True)
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---------------------------------------------------------- push thread
    def _run(self) -> None:
        while not self._stop.is_set():
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
            self._handle(*event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

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

    def _reserve(self, job: PushJob) -> None:
        try:
            job.link = self.client.connect(job.endpoint)
            job.res = job.link.reserve(job.transfer_id, job.keys, job.nbytes, self.lease_ms)
            job.last_heartbeat = time.monotonic()
        except FabricError as exc:
            self._fail(job, f"reserve on {job.endpoint} failed: {exc}")

    def _write(self, req_id: str, index: int, slot: int) -> None:
        job = self._jobs.get(req_id)
        if job is None or job.failed or job.link is None or job.res is None:
            self.store.release_slots([slot])
            return
        try:
            push = job.link.write(job.res, [index], [slot])
        except FabricError as exc:
            self.store.release_slots([slot])
            self._fail(job, f"write of chunk {index} failed: {exc}")
            return
        job.written += 1
        job.inflight.append((slot, push, time.monotonic()))

    def _progress(self) -> None:
        now = time.monotonic()
        for job in list(self._jobs.values()):
            still = []
            for slot, push, started in job.inflight:
                try:
                    done = push.done()
                except FabricError as exc:
                    self.store.release_slots([slot])
                    self._fail(job, f"write failed: {exc}")
                    continue
                if done:
                    self.store.release_slots([slot])
                    self.counters.add(chunks_sent=1, bytes_sent=push.nbytes)
                    self.counters.observe("chunk_write_seconds", now - started)
                elif now - started > self.push_timeout_s:
                    self.store.release_slots([slot])
                    self._fail(job, f"write not done in {self.push_timeout_s} s")
                else:
                    still.append((slot, push, started))
            job.inflight = still
            self._heartbeat(job, now)
            self._maybe_drop(job)

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
        self.counters.add(push_failures=1)
        logger.warning("fabric push %s (request %s): %s", job.transfer_id, job.req_id, why)
        if job.link is not None and job.res is not None:
            try:
                job.link.cancel(job.transfer_id)
            except FabricError as exc:
                logger.info("cancel of %s failed too: %s", job.transfer_id, exc)
