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
      answers Refused(BUSY)                |
    wake_fd readable <--------------------- done queue + one byte on a pipe
    take_done() -> (identity, reply):
      the loop sends it on its own socket

ZMQ sockets are not thread-safe, so an offload thread never touches the
socket: finished replies wait in a thread-safe queue, and a byte written to
a pipe (which the loop polls beside its socket) wakes the loop to send
them. A work item that raises is answered ``Refused(internal_error)`` and
counted; the threads keep serving.

Shutting down, in the owner's order (see ``TransferServer.close``)::

    shutdown()          refuse new work (submit -> False, ``closed``); every
                        queued job is answered Refused(CLOSING) at once
    wait_idle(timeout)  wait for the jobs running now (True: none runs)
    close()             join the threads, close the pipe (kept open while a
                        thread still runs: it may write to it yet, and a
                        closed fd's number may be reused by then)
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fabric.threads import thread as named_thread
from fabric.transfer import protocol as proto

logger = logging.getLogger(__name__)

MAX_REASON_CHARS = 512
# ``Refused.code`` of a request whose queue was full: a transient refusal
# (ask again later), not a failure of the peer.
BUSY = proto.Refusal.BUSY
# ``Refused.code`` of a request queued (or sent) while the server closes.
CLOSING = proto.Refusal.CLOSING


@dataclass(frozen=True)
class _Job:
    identity: bytes
    seq: int
    work: Callable[[], proto.Message]


class Offload:
    """A few threads running blocking work; replies collected for the loop."""

    def __init__(self, *, threads: int = 2, max_queued: int = 64, name: str = "fabric-offload"):
        self.name, self.max_queued = name, max_queued
        self._jobs: collections.deque[_Job] = collections.deque()
        self._done: queue.SimpleQueue[tuple[bytes, proto.Message]] = queue.SimpleQueue()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._fds: tuple[int, ...] = (self.wake_fd, self._wake_w)
        # NOTE: guards the jobs, ``_running`` and ``_closed``; a reply is put
        # in ``_done`` under it too, so ``pending`` never misses or doubles one.
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False
        self.busy = 0  # submits refused: the queue was full
        short = "f" + name.removeprefix("fabric-")[:10]  # NOTE: fabric-offload-0 -> foffload-0
        self._threads = [
            named_thread(self._run, name=f"{name}-{i}", os_name=f"{short}-{i}")
            for i in range(threads)
        ]

    def start(self) -> Offload:
        for thread in self._threads:
            thread.start()
        return self

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` ran (``submit`` refuses everything)."""
        with self._cond:
            return self._closed

    def submit(self, identity: bytes, seq: int, work: Callable[[], proto.Message]) -> bool:
        """Queue ``work``; its reply goes to ``identity``. False when the queue
        is full (counted in ``busy``) or the offload is shut down (``closed``)."""
        with self._cond:
            if self._closed:
                return False
            if len(self._jobs) >= self.max_queued:
                self.busy += 1
                return False
            self._jobs.append(_Job(identity, seq, work))
            self._cond.notify()
        return True

    def take_done(self) -> list[tuple[bytes, proto.Message]]:
        """Replies finished since the last call (for the loop to send)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def pending(self) -> int:
        """Work queued or running, plus replies not yet taken."""
        with self._cond:
            return len(self._jobs) + self._running + self._done.qsize()

    def running(self) -> int:
        """Jobs running now."""
        with self._cond:
            return self._running

    def shutdown(self) -> int:
        """Refuse new work and answer every queued job ``Refused(CLOSING)``
        (the loop sends those replies like any other); returns how many."""
        with self._cond:
            self._closed = True
            cancelled = list(self._jobs)
            self._jobs.clear()
            for job in cancelled:
                reason = "the server is closing; the request was not served"
                self._done.put((job.identity, proto.Refused(job.seq, "", CLOSING, reason)))
            self._cond.notify_all()
        if cancelled:
            self.wake()
        return len(cancelled)

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s until no job runs; True when none does."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._running or (self._jobs and not self._closed):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Shut down, wait for the running jobs and the threads (one deadline
        of ``timeout`` s for all), then close the pipe; False (the pipe kept
        open, a warning logged) when a job still runs past it."""
        deadline = time.monotonic() + timeout
        self.shutdown()
        self.wait_idle(timeout)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        alive = sum(thread.is_alive() for thread in self._threads)
        if alive:
            # NOTE: a thread still runs long work: it may write to the pipe
            # yet, and a closed fd's number may be reused by then.
            logger.warning("fabric server: %d %s job(s) still running at close", alive, self.name)
            return False
        with self._cond:
            fds, self._fds = self._fds, ()
        for fd in fds:  # NOTE: once: a second close must not close a reused fd number
            with contextlib.suppress(OSError):
                os.close(fd)
        return True

    def _run(self) -> None:
        while (job := self._next()) is not None:
            reply: proto.Message | None = None
            try:
                reply = self._call(job)
            finally:
                with self._cond:
                    self._running -= 1
                    if reply is not None:
                        self._done.put((job.identity, reply))
                    self._cond.notify_all()
            self.wake()

    def _next(self) -> _Job | None:
        """The next job (counted running), or None once shut down and drained."""
        with self._cond:
            while not self._jobs:
                if self._closed:
                    return None
                self._cond.wait()
            self._running += 1
            return self._jobs.popleft()

    def wake(self) -> None:
        """Make ``wake_fd`` readable: wakes the loop that polls it (a reply
        done, its owner stopping, new state it must tend)."""
        # NOTE: a full pipe already wakes the loop; a closed one means it stopped.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _call(self, job: _Job) -> proto.Message:
        try:
            return job.work()
        except Exception as exc:
            logger.exception("fabric server: offloaded work failed")
            reason = f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
            return proto.Refused(job.seq, "", proto.Refusal.INTERNAL_ERROR, reason)
