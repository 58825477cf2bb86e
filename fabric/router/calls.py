"""Engine calls in flight, cut at once when their engine becomes unreachable.

A partition (no bytes, no RST, no FIN) leaves a call that reads from an
engine waiting for its read timeout (``decode_timeout_s``, 600 s by
default, per gap between two chunks of a stream). Once the proxy learns
that the engine cannot be reached (a health probe or a request's connect
timed out, and a fresh TCP connection timed out or found no route too; a
refused one is not unreachable:
:meth:`fabric.router.engines.Engine.mark_unreachable`), every call still
reading from it ends at once with :class:`EngineUnreachable`, an
``httpx.TransportError`` the proxy answers like any other engine failure:
a stream gets an error event, a decode a 502, a prefill falls back.

How: a call records the task that awaits it (:meth:`EngineCalls.open`).
The cut cancels that task while it is inside a read window (``with
call:``), and the window's exit turns that cancel into
``EngineUnreachable``. Outside a window (a stream's task sending a chunk to
the client) the cut is only recorded, and the next window raises at once,
so the client's side is never interrupted::

    stream task:  [read]--send chunk--[read]--send chunk--[read] ...
    cut in [read]:      the task is cancelled: the read raises now
    cut while sending:  recorded: the next [read] raises before it waits

NOTE: cancelling the waiting task is the one way to end a pending read that
all three pools (:mod:`fabric.router.transport`) take alike: each already
handles a cancel at any await (a client that leaves is one) by dropping
the connection. Closing a connection under a pending read is handled
differently by each, and racing every read against an event would cost a
task per chunk. A cancel the cut did not make (the client left, the
request's deadline) stays a cancel, even when both come at once; a call
whose task was being cancelled already when the cut came is not counted as
cut (``fabric_proxy_calls_cut_total`` counts each call the cut ended, once).

Everything here runs on the proxy's event loop (not thread-safe).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import httpx


class EngineUnreachable(httpx.TransportError):
    """The engine became unreachable while the call was in flight; the
    message says how the proxy learnt it."""


class EngineCalls:
    """The calls in flight to one engine."""

    def __init__(self) -> None:
        self._open: set[Call] = set()
        self.cut_total = 0  # calls cut so far

    def __len__(self) -> int:
        return len(self._open)

    def open(self) -> Call:
        """A call of the current task, reading in its ``with`` windows; ``close()`` it."""
        call = Call(self)
        self._open.add(call)
        return call

    def reading(self) -> Call:
        """A call that is one read window: ``with engine.calls.reading(): await ...``."""
        call = self.open()
        call.once = True
        return call

    def cut(self, reason: str) -> int:
        """End every call in flight with :class:`EngineUnreachable` (``reason``);
        how many the cut ended (counted once each: see :meth:`Call.cut`)."""
        cut = sum(call.cut(reason) for call in list(self._open))
        self.cut_total += cut
        return cut


class Call:
    """One call in flight: its task, whether it is reading, and its cut (if any)."""

    __slots__ = ("_calls", "_cancelled", "_task", "error", "once", "reading")

    def __init__(self, calls: EngineCalls) -> None:
        self._calls = calls
        self._task = asyncio.current_task()
        self._cancelled = False  # the cut cancelled the task; not seen yet
        self.error: EngineUnreachable | None = None
        self.once = False  # the first window's exit closes the call
        self.reading = False

    def resume(self) -> None:
        """Open a read window; :class:`EngineUnreachable` at once if the call was cut."""
        if self.error is not None:
            raise self.error
        self.reading = True

    def __enter__(self) -> Call:
        self.resume()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.reading = False
        if self.once:
            self.close()
        if not self._cancelled:
            return
        self._cancelled = False
        assert self._task is not None and self.error is not None
        # NOTE: as asyncio.timeout does: another cancel pending (the client
        # left, the deadline) goes on as a cancel.
        if self._task.uncancel() == 0 and (kind is None or kind is asyncio.CancelledError):
            raise self.error from None

    def close(self) -> None:
        """The call ended (idempotent)."""
        self._calls._open.discard(self)

    def cut(self, reason: str) -> bool:
        """End the call with :class:`EngineUnreachable`; whether the cut ended
        it. False: cut already, or its task was being cancelled already (a
        client that left, a deadline, a prefill leg its engine's ``mark_down``
        cancelled): that cancel ends it, as a cancel (see ``__exit__``)."""
        if self.error is not None:
            return False
        self.error = EngineUnreachable(reason)
        task = self._task
        if task is None or task is asyncio.current_task():
            return True
        ending = task.cancelling() > 0
        if self.reading:
            self._cancelled = task.cancel(f"engine unreachable: {reason}")
        return not ending
