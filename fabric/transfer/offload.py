"""Blocking work of the transfer server, run off its loop.

The server's loop thread owns the ZMQ socket and must stay prompt: it polls
notifications, answers heartbeats and Reserves, and expires leases. A
request whose answer needs disk I/O or a long wait (a Lookup that reads
chunks back from the disk tier, a Clear that unlinks thousands of files
and first waits for the disk writer, a shared-store Fetch) is handed to an
:class:`Offload` instead::

    loop thread                         offload threads (``threads``)
    -----------                         ---------------------------
    submit(identity, seq, work) ------> queue (at most ``max_queued``)
      full? -> False: the loop             work() -> reply
      answers Refused("busy")              |
    wake_fd readable <--------------------- done queue + one byte on a pipe
    take_done() -> (identity, reply):
      the loop sends it on its own socket

ZMQ sockets are not thread-safe, so an offload thread never touches the
socket: finished replies wait in a thread-safe queue, and a byte written to
a pipe (which the loop polls beside its socket) wakes the loop to send
them. A work item that raises is answered ``Refused(internal_error)`` and
counted; the threads keep serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from fabric.transfer import protocol as proto

logger = logging.getLogger(__name__)

MAX_REASON_CHARS = 512


@dataclass(frozen=True)
class _Job:
    identity: bytes
    seq: int
    work: Callable[[], proto.Message]


class Offload:
    """A few threads running blocking work; replies collected for the loop."""

    def __init__(self, *, threads: int = 2, max_queued: int = 64, name: str = "fabric-offload"):
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queued)
        self._done: queue.SimpleQueue[tuple[bytes, proto.Message]] = queue.SimpleQueue()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._running = 0
        self.busy = 0  # submits refused: the queue was full
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]

    def start(self) -> Offload:
        for thread in self._threads:
            thread.start()
        return self

    def submit(self, identity: bytes, seq: int, work: Callable[[], proto.Message]) -> bool:
        """Queue ``work``; its reply goes to ``identity``. False when full."""
        try:
            self._jobs.put_nowait(_Job(identity, seq, work))
        except queue.Full:
            self.busy += 1
            return False
        return True

    def take_done(self) -> list[tuple[bytes, proto.Message]]:
        """Replies finished since the last call (for the loop to send)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def pending(self) -> int:
        """Work queued or running, plus replies not yet taken."""
        with self._lock:
            running = self._running
        return self._jobs.qsize() + running + self._done.qsize()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads after the work they run now (queued work is dropped:
        its clients time out)."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            try:
                self._jobs.put(None, timeout=timeout)
            except queue.Full:
                break
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=timeout)
        if any(thread.is_alive() for thread in self._threads):
            # NOTE: a thread still runs long work: it may write to the pipe
            # yet, and a closed fd's number may be reused by then.
            logger.warning("fabric server: offloaded work still running at close")
            return
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._running += 1
            try:
                reply = self._call(job)
                self._done.put((job.identity, reply))
                self._wake()
            finally:
                with self._lock:
                    self._running -= 1

    def _wake(self) -> None:
        # NOTE: a full pipe already wakes the loop; a closed one means it stopped.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _call(self, job: _Job) -> proto.Message:
        try:
            return job.work()
        except Exception as exc:
            logger.exception("fabric server: offloaded work failed")
            reason = f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
            return proto.Refused(job.seq, "", "internal_error", reason)
