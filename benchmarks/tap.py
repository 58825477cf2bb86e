"""A timing relay in front of an engine: when each HTTP request arrived and its answer began.

``benchmarks/pd_vs_nixl.py`` puts one in front of each PD stack's
prefiller, so it can time P's answer with the same clock as the client's
first token whatever proxy (fabric's, or :mod:`benchmarks.nixl_proxy`)
sits in between::

    proxy --HTTP--> TimingTap (127.0.0.1:N) --the same bytes--> P

Bytes pass through unchanged both ways (no HTTP parsing beyond reading a
request's first line), so all the proxy asks of P (health probes, metrics,
canaries, generations) works through it. On each connection a *turn*
starts with the first bytes the client sends after P last answered (or
after connecting) and its answer with the first bytes P sends back: HTTP/1.1
without pipelining, which is what the proxies speak. Each turn is a
:class:`TapEvent` stamped with ``clock`` (``time.perf_counter`` by default,
the benchmark client's clock) when the bytes reach the tap, before they
are passed on. The cost is one loopback hop each way on P's leg.

:class:`TapThread` serves taps from an event loop in a daemon thread of the
calling process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

READ_BYTES = 256 * 1024
MAX_LINE = 200


@dataclass
class TapEvent:
    """One request through the tap (times from the tap's clock, in seconds)."""

    first_line: str
    sent_s: float  # the request's first bytes reached the tap
    answered_s: float | None = None  # the answer's first bytes reached the tap
    ended_s: float | None = None  # the latest answer bytes so far

    @property
    def method(self) -> str:
        """The request's method (``POST``), or ``""``."""
        return self.first_line.split(" ", 1)[0]

    @property
    def path(self) -> str:
        """The request's path (``/v1/completions``), or ``""``."""
        parts = self.first_line.split(" ")
        return parts[1] if len(parts) > 1 else ""


def first_line(data: bytes) -> str:
    """The first line of an HTTP request (at most ``MAX_LINE`` characters)."""
    return data.split(b"\r\n", 1)[0][:MAX_LINE].decode("latin-1")


class TimingTap:
    """Relays connections to ``upstream_host:upstream_port``; records a :class:`TapEvent` per turn.

    ``max_events`` bounds the events kept (oldest dropped).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
        max_events: int = 10_000,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.clock = clock
        self._events: deque[TapEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The port the tap listens on (after :meth:`serve`)."""
        assert self._server is not None, "the tap is not serving"
        return int(self._server.sockets[0].getsockname()[1])

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start listening; the port."""
        self._server = await asyncio.start_server(self._connection, host, port)
        return self.port

    async def close(self) -> None:
        """Stop listening (connections in flight end with their peers)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def events(self, since_s: float | None = None) -> list[TapEvent]:
        """The recorded events (those sent at or after ``since_s``), oldest first."""
        with self._lock:
            events = list(self._events)
        return [e for e in events if since_s is None or e.sent_s >= since_s]

    def generations(self, since_s: float, paths: tuple[str, ...] = ("/v1/",)) -> list[TapEvent]:
        """POSTs to ``paths`` sent at or after ``since_s`` (what the proxy asked P to compute)."""
        return [e for e in self.events(since_s) if e.method == "POST" and e.path.startswith(paths)]

    def _add(self, event: TapEvent) -> None:
        with self._lock:
            self._events.append(event)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        turn: list[TapEvent | None] = [None]

        async def requests() -> None:
            while data := await reader.read(READ_BYTES):
                now = self.clock()
                event = turn[0]
                if event is None or event.answered_s is not None:
                    turn[0] = event = TapEvent(first_line(data), now)
                    self._add(event)
                up_writer.write(data)
                await up_writer.drain()

        async def answers() -> None:
            while data := await up_reader.read(READ_BYTES):
                now = self.clock()
                event = turn[0]
                if event is not None:
                    if event.answered_s is None:
                        event.answered_s = now
                    event.ended_s = now
                writer.write(data)
                await writer.drain()

        pumps = [asyncio.ensure_future(requests()), asyncio.ensure_future(answers())]
        try:
            # NOTE: either side closing ends the connection on both.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # NOTE: the tap is closing; asyncio's server would log a cancelled handler
        finally:
            for pump in pumps:
                pump.cancel()
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            await asyncio.gather(*pumps, return_exceptions=True)


class TapThread:
    """An event loop in a daemon thread that serves :class:`TimingTap` s until :meth:`close`."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="timing-taps")
        self._thread.daemon = True
        self._thread.start()
        self._taps: list[TimingTap] = []

    def tap(self, upstream_url: str, host: str = "127.0.0.1") -> tuple[str, TimingTap]:
        """A new tap in front of ``upstream_url``; its URL and the tap."""
        parts = urlsplit(upstream_url)
        assert parts.hostname is not None and parts.port is not None, upstream_url
        tap = TimingTap(parts.hostname, parts.port)
        port = asyncio.run_coroutine_threadsafe(tap.serve(host), self._loop).result(10)
        self._taps.append(tap)
        return f"http://{host}:{port}", tap

    def close(self) -> None:
        """Stop every tap, end the connections in flight, stop the loop."""

        async def stop() -> None:
            for tap in self._taps:
                await tap.close()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> TapThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
