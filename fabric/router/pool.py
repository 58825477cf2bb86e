"""A small HTTP/1.1 keep-alive pool for the engine calls of the PD flow,
and :func:`open_engines`, which makes it and the proxy's admin client.

Each connection is an
``asyncio.Protocol`` whose bytes go through httptools' C parser (uvicorn's):
a POST is one ``writelines`` of a pre-built head and the body, and the
answer arrives through parser callbacks, without any per-request objects
beyond one :class:`_Response`. Measured on this box (a client posting to a
fake engine in a loop, client CPU per request): aiohttp's client ~4x the
cost of this path; two such calls per proxied request made aiohttp the
proxy's largest cost.

What it supports is what engines need: ``POST`` with a body, answers with
``Content-Length``, chunked or read-to-close bodies, keep-alive. Idle
connections are reused newest first and dropped after ``KEEPALIVE_S``
(below the engines' own idle timeout, see :mod:`fabric.router.transport`);
at most ``proxy.max_connections`` are open per engine (later calls wait for
one to come back or close, at most ``Timeouts.pool`` seconds: then
``httpx.PoolTimeout``).

Timeouts: ``pool`` bounds the wait for a free connection, ``connect``
opening one, ``read`` each wait for bytes (the head, then every part of
the body). A body read whole (``read(limit)``) past ``limit`` bytes fails
with :class:`~fabric.router.transport.AnswerTooLarge` as soon as the
declared length or the bytes received pass it (nothing more is buffered,
the connection is dropped). Failures raise httpx's exceptions like the
rest of the proxy expects: ``ConnectError`` / ``ConnectTimeout``, ``PoolTimeout``,
``ReadTimeout``, ``RemoteProtocolError`` (the engine closed the connection
or sent something that is not HTTP).

::

    post(url) --> _Pool.acquire --> idle _Connection (or a new one)
                     transport.writelines([head, body])
    engine --bytes--> data_received -> parser -> on_headers_complete ->
                      _Response.status ... on_body -> chunks queue
                      on_message_complete -> done; close() -> back to the pool
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools
import httpx

from fabric.router.transport import (
    KEEPALIVE_S,
    AnswerTooLarge,
    EngineHTTP,
    EngineResponse,
    Timeouts,
    check_length,
)

HIGH_WATER = 256 * 1024
"""Bytes of an answer buffered before reading from its connection pauses."""


class _Target:
    """One engine URL, parsed once: where to connect, and the request line and host."""

    __slots__ = ("key", "prefix")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self.key = (parts.scheme, parts.hostname, port)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rsplit("@", 1)[-1]
        self.prefix = f"POST {path} HTTP/1.1\r\nhost: {host}\r\n".encode("ascii")


class HttptoolsEngines(EngineHTTP):
    """Engine calls over :class:`_Pool`s, one per (scheme, host, port), each of at
    most ``max_connections`` connections."""

    def __init__(self, max_connections: int) -> None:
        self._per_engine = max_connections
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        self._targets: dict[str, _Target] = {}

    async def post(
        self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> EngineResponse:
        """POST ``content``; return once the answer's head is in."""
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _Target(url)
        pool = self._pools.get(target.key)
        if pool is None:
            pool = self._pools[target.key] = _Pool(target.key, self._per_engine)
        head = _request_head(target.prefix, headers, len(content))
        for attempt in range(2):
            connection = await pool.acquire(timeouts.connect, timeouts.pool_s)
            reused = connection.idle_since > 0
            response = _Response(pool, connection, timeouts.read)
            try:
                connection.send(response, head, content)
                await response.wait_head()
            except httpx.RemoteProtocolError:
                await response.close()
                # NOTE: an engine closes an idle keep-alive connection on its own
                # timer; one picked from the pool as that happens fails before
                # any answer, with the request never read. Retry it once on a
                # new connection (urllib3 and httpcore do the same).
                if reused and not response.answered and attempt == 0:
                    continue
                raise
            except BaseException:
                await response.close()
                raise
            return response
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def tables(self) -> dict[str, int]:
        """Calls waiting for a connection, connections with an answer in flight."""
        pools = self._pools.values()
        return {
            "pool_waiters": sum(len(p.waiters) for p in pools),
            # NOTE: an idle connection the engine closed is no longer open, but
            # stays in ``idle`` until the next acquire drops it
            "pool_busy": sum(p.open - sum(not c.closed for c in p.idle) for p in pools),
        }


def _request_head(prefix: bytes, headers: Mapping[str, str], length: int) -> bytes:
    lines = [prefix]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise httpx.LocalProtocolError(f"header {name} holds a line break")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.append(b"content-length: %d\r\n\r\n" % length)
    return b"".join(lines)


class _Pool:
    """Connections to one engine: at most ``size`` open, idle ones reused newest first."""

    def __init__(self, key: tuple[str, str, int], size: int) -> None:
        self.key = key
        self.size = size
        self.open = 0
        self.idle: list[_Connection] = []
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self, connect_timeout: float, pool_timeout: float) -> _Connection:
        """The newest usable idle connection, or a new one (waiting while ``size``
        are open, at most ``pool_timeout`` seconds in all: then ``httpx.PoolTimeout``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + pool_timeout
        while True:
            now = loop.time()
            while self.idle:
                connection = self.idle.pop()
                if connection.usable(now):
                    return connection
                connection.abort()
            if self.open < self.size:
                return await self._connect(loop, connect_timeout)
            waiter = loop.create_future()
            self.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then gave up: the turn passes on
                if isinstance(exc, TimeoutError):
                    _, host, port = self.key
                    raise httpx.PoolTimeout(
                        f"no free connection to {host}:{port} within {pool_timeout:g} s "
                        f"({self.size} in use, proxy.max_connections)"
                    ) from None
                raise

    def release(self, connection: _Connection) -> None:
        """Take ``connection`` back after a complete answer."""
        connection.idle_since = asyncio.get_running_loop().time()
        self.idle.append(connection)
        self._wake_one()

    def lost(self) -> None:
        """One of this pool's connections closed."""
        self.open -= 1
        self._wake_one()

    def close(self) -> None:
        for connection in self.idle:
            connection.abort()
        self.idle.clear()

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self, loop: asyncio.AbstractEventLoop, timeout: float) -> _Connection:
        scheme, host, port = self.key
        self.open += 1
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self),
                    host,
                    port,
                    ssl=ssl.create_default_context() if scheme == "https" else None,
                )
        except BaseException as exc:
            self.lost()
            if isinstance(exc, TimeoutError):
                raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
            if isinstance(exc, OSError):
                raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
            raise
        return connection


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one answer in flight."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._response: _Response | None = None
        self.closed = False
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        transport = self._transport
        return (
            not self.closed
            and transport is not None
            and not transport.is_closing()
            and now - self.idle_since < KEEPALIVE_S
        )

    def send(self, response: _Response, head: bytes, content: bytes) -> None:
        assert self._transport is not None and self._response is None
        self._response = response
        self._transport.writelines((head, content))

    def done(self) -> None:
        """The answer in flight is complete or abandoned."""
        self._response = None

    def pause(self, paused: bool) -> None:
        if self._transport is not None and not self.closed:
            if paused:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection (an answer not read to its end, or a stale one)."""
        if self._transport is not None:
            self._transport.abort()
        self._lost()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports are not asyncio.Transport subclasses
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._response is None:  # bytes nobody asked for: the stream is out of step
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._response is not None:
                self._response.fail(httpx.RemoteProtocolError(f"invalid HTTP answer: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()
        if self._response is not None:
            self._response.closed_by_server()

    def _lost(self) -> None:
        if not self.closed:
            self.closed = True
            self._pool.lost()

    # httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._response.on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._response is not None:
            parser = self._parser
            self._response.on_head(parser.get_status_code(), parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response.on_body(body)

    def on_message_complete(self) -> None:
        if self._response is not None:
            self._response.on_complete()


class _Response(EngineResponse):
    """One answer as its bytes arrive; see :class:`EngineResponse`."""

    def __init__(self, pool: _Pool, connection: _Connection, read_timeout: float) -> None:
        self._pool = pool
        self._connection = connection
        self._read_timeout = read_timeout
        self._loop = asyncio.get_running_loop()
        self.status = 0
        self.content_type: str | None = None
        self._keep_alive = False
        self._until_close = True  # no Content-Length and not chunked: the body ends at EOF
        self._head = False
        self._complete = False
        self._error: Exception | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._whole = False  # read() takes the body whole: never pause reading
        self._limit: int | None = None  # read(limit): bytes it may buffer
        self._length: str | None = None  # the declared Content-Length
        self._overflow = False  # past the limit: later bytes are dropped
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    @property
    def answered(self) -> bool:
        """Whether any of the answer (its head) arrived."""
        return self._head

    async def wait_head(self) -> None:
        while not self._head:
            await self._wait()

    async def read(self, limit: int | None = None) -> bytes:
        if limit is not None:
            try:
                check_length(self._length, limit)
                if self._buffered > limit:
                    raise AnswerTooLarge(limit)
            except AnswerTooLarge:
                self._overflow = True  # NOTE: close() drops the connection
                raise
        self._whole = True
        self._limit = limit
        if self._paused:
            self._paused = False
            self._connection.pause(False)
        while not self._complete:
            await self._wait()
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered < HIGH_WATER // 2:
                    self._paused = False
                    self._connection.pause(False)
                yield chunk
            elif self._complete:
                return
            else:
                await self._wait()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        connection.done()
        if self._complete and self._keep_alive and not connection.closed and not self._overflow:
            if self._paused:
                connection.pause(False)
            self._pool.release(connection)
        else:
            connection.abort()

    async def _wait(self) -> None:
        """Until the connection delivers something; ReadTimeout after the read timeout."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(self._read_timeout, self._time_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _time_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(httpx.ReadTimeout(f"no answer within {self._read_timeout} s"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: Exception) -> None:
        if self._error is None and not self._complete:
            self._error = error
        self._wake()

    def closed_by_server(self) -> None:
        if self._head and self._until_close:
            self.on_complete()
            self._keep_alive = False
            return
        what = "in the middle of its answer" if self._head else "without answering"
        self.fail(httpx.RemoteProtocolError(f"the engine closed the connection {what}"))

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1")
        elif name == b"content-length" or (
            name == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._until_close = False
            if name == b"content-length":
                self._length = value.decode("latin-1")

    def on_head(self, status: int, keep_alive: bool) -> None:
        self.status = status
        self._keep_alive = keep_alive and not self._until_close
        self._head = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        limit = self._limit
        if limit is not None and self._buffered + len(body) > limit:
            # NOTE: nothing more is kept, nor read; close() drops the connection
            self._chunks.clear()
            self._buffered = 0
            self._limit = None
            self._overflow = True
            self._connection.pause(True)
            self.fail(AnswerTooLarge(limit))
            return
        if self._overflow:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if not self._paused and not self._whole and self._buffered > HIGH_WATER:
            self._paused = True
            self._connection.pause(True)
        self._wake()

    def on_complete(self) -> None:
        self._complete = True
        self._wake()


def open_engines(
    per_engine: int, max_connections: int, timeout: httpx.Timeout
) -> tuple[EngineHTTP, httpx.AsyncClient]:
    """The engine client of the PD flow, and a plain ``httpx.AsyncClient`` for
    the rest (health probes, canaries' admin calls, admin routes).

    ``per_engine`` bounds the pool's connections to each engine; the httpx
    client keeps at most ``max_connections`` (``per_engine`` times the engines).
    """
    # NOTE: keepalive_expiry: httpx's default (5 s) is the engines' own idle
    # timeout; a connection the engine is closing must not be picked (KEEPALIVE_S).
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=KEEPALIVE_S,
    )
    # NOTE: trust_env=False: engine traffic must never go through an
    # HTTP(S)_PROXY from the environment, and no .netrc lookups per request.
    client = httpx.AsyncClient(limits=limits, trust_env=False, timeout=timeout)
    return HttptoolsEngines(per_engine), client
