"""The proxy's engine pool (httptools, :mod:`fabric.router.pool`) against scripted servers.

Each server answers every request it reads with the next scripted reply (raw
bytes, or a function of the request; a reply saying ``connection: close``
closes the connection after it), so framing, reuse, back-pressure and
failures are exercised without an engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from fabric.router.pool import HIGH_WATER, HttptoolsEngines
from fabric.router.transport import AnswerTooLarge, Timeouts

TIMEOUTS = Timeouts(connect=2.0, read=2.0)
HEADERS = {"content-type": "application/json", "x-request-id": "t-1"}

Reply = bytes | Callable[[bytes], bytes] | None  # None: close without answering


class Scripted:
    """A loopback server: one reply per request; counts connections and requests."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = replies
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/completions"

    async def __aexit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                reply = self.replies.pop(0)
                if reply is None:
                    break
                data = reply(request) if callable(reply) else reply
                writer.write(data)
                await writer.drain()
                if b"connection: close" in data:
                    break
            else:
                await reader.read()  # no more replies: hold the connection until the client leaves
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def answer(body: bytes, *, status: int = 200, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b" % (
        status,
        len(body),
        extra,
        body,
    )


def chunked(body: bytes, size: int) -> bytes:
    parts = [
        b"%x\r\n%b\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + b"".join(parts) + b"0\r\n\r\n"


def run(
    replies: list[Reply], scenario: Callable[[HttptoolsEngines, str], Any]
) -> tuple[Any, Scripted]:
    async def main() -> Any:
        server = Scripted(replies)
        engines = HttptoolsEngines(max_connections=8)
        async with server as url:
            try:
                return await scenario(engines, url), server
            finally:
                await engines.aclose()

    return asyncio.run(main())


def test_sequential_calls_reuse_one_connection_and_send_the_request_as_given() -> None:
    async def scenario(engines: HttptoolsEngines, url: str) -> list[bytes]:
        bodies = []
        for i in range(3):
            response, body = await engines.post_read(url, b'{"n":%d}' % i, HEADERS, TIMEOUTS)
            assert (response.status, response.content_type) == (200, "application/json")
            bodies.append(body)
        return bodies

    bodies, server = run([answer(b'{"ok":%d}' % i) for i in range(3)], scenario)

    assert bodies == [b'{"ok":0}', b'{"ok":1}', b'{"ok":2}']
    assert server.connections == 1
    head, body = server.requests[2].split(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"x-request-id: t-1" in head and b"content-length: 7" in head
    assert body == b'{"n":2}'


@pytest.mark.parametrize("whole", [True, False])
def test_a_chunked_answer_larger_than_the_buffer_arrives_intact(whole: bool) -> None:
    payload = bytes(range(256)) * (3 * HIGH_WATER // 256)

    async def scenario(engines: HttptoolsEngines, url: str) -> bytes:
        response = await engines.post(url, b"{}", HEADERS, TIMEOUTS)
        try:
            if whole:
                return await response.read()
            parts = []
            async for chunk in response.chunks():
                parts.append(chunk)
                await asyncio.sleep(0)  # a slow reader: reading from the socket pauses
            return b"".join(parts)
        finally:
            await response.close()

    body, _ = run([chunked(payload, 16384)], scenario)

    assert body == payload


def test_an_answer_ending_at_close_is_read_to_the_end_and_not_reused() -> None:
    async def scenario(engines: HttptoolsEngines, url: str) -> list[bytes]:
        bodies = []
        for _ in range(2):
            _, body = await engines.post_read(url, b"{}", HEADERS, TIMEOUTS)
            bodies.append(body)
        return bodies

    close_delimited: Reply = b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"a":1}'
    bodies, server = run([close_delimited, answer(b"{}")], scenario)

    assert bodies == [b'{"a":1}', b"{}"]
    assert server.connections == 2


def test_failures_raise_httpx_errors() -> None:
    async def scenario(engines: HttptoolsEngines, url: str) -> list[type[Exception]]:
        errors: list[type[Exception]] = []
        for _ in range(3):
            try:
                await engines.post_read(url, b"{}", HEADERS, Timeouts(connect=2.0, read=0.3))
            except httpx.TransportError as exc:
                errors.append(type(exc))
        return errors

    def silent(request: bytes) -> bytes:
        return b""  # reads the request, never answers: a read timeout

    errors, _ = run([None, b"NOT HTTP\r\n\r\n", silent], scenario)

    assert errors == [httpx.RemoteProtocolError, httpx.RemoteProtocolError, httpx.ReadTimeout]


def test_a_refused_connection_is_a_connect_error() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        engines = HttptoolsEngines(max_connections=1)
        with pytest.raises(httpx.ConnectError):
            await engines.post(f"http://127.0.0.1:{port}/x", b"", HEADERS, TIMEOUTS)
        await engines.aclose()

    asyncio.run(main())


def test_calls_past_max_connections_wait_for_a_free_one() -> None:
    async def main() -> tuple[list[bytes], int]:
        server = Scripted([answer(b'{"i":%d}' % i) for i in range(3)])
        engines = HttptoolsEngines(max_connections=1)
        async with server as url:
            calls = [engines.post_read(url, b"{}", HEADERS, TIMEOUTS) for _ in range(3)]
            bodies = [body for _, body in await asyncio.gather(*calls)]
            await engines.aclose()
        return bodies, server.connections

    bodies, connections = asyncio.run(main())

    assert sorted(bodies) == [b'{"i":0}', b'{"i":1}', b'{"i":2}']
    assert connections == 1


def test_a_reused_connection_closed_before_answering_is_retried_once_on_a_new_one() -> None:
    """An engine closing an idle keep-alive connection as the pool hands it
    out: the request is sent again on a new connection, once; a connection
    that was new when it failed is not retried (see the test above)."""

    async def scenario(engines: HttptoolsEngines, url: str) -> list[bytes]:
        bodies = []
        for i in range(2):
            _, body = await engines.post_read(url, b'{"n":%d}' % i, HEADERS, TIMEOUTS)
            bodies.append(body)
        return bodies

    bodies, server = run([answer(b'{"ok":0}'), None, answer(b'{"ok":1}')], scenario)

    assert bodies == [b'{"ok":0}', b'{"ok":1}']
    assert server.connections == 2 and len(server.requests) == 3


def test_a_call_waiting_past_the_pool_timeout_for_a_connection_is_a_pool_timeout() -> None:
    """One connection, held by a call the engine never answers: the next call
    waits for it at most ``Timeouts.pool``, then fails with PoolTimeout (before,
    it waited as long as the first call held the connection)."""

    def silent(request: bytes) -> bytes:
        return b""

    async def main() -> tuple[type[Exception], dict[str, int], dict[str, int]]:
        server = Scripted([silent])
        engines = HttptoolsEngines(max_connections=1)
        async with server as url:
            held = asyncio.create_task(
                engines.post_read(url, b"{}", HEADERS, Timeouts(connect=2.0, read=30.0))
            )
            while server.requests == []:
                await asyncio.sleep(0.01)
            try:
                async with asyncio.timeout(10):  # hang guard
                    await engines.post(url, b"{}", HEADERS, Timeouts(2.0, 2.0, pool=0.2))
            except httpx.PoolTimeout as exc:
                error: type[Exception] = type(exc)
                assert "no free connection" in str(exc) and "max_connections" in str(exc)
            tables = engines.tables()
            held.cancel()
            with pytest.raises(asyncio.CancelledError):
                await held
            after = engines.tables()
            await engines.aclose()
        return error, tables, after

    error, tables, after = asyncio.run(main())

    assert error is httpx.PoolTimeout
    assert tables == {"pool_waiters": 0, "pool_busy": 1}
    assert after == {"pool_waiters": 0, "pool_busy": 0}


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_answer_past_the_read_limit_fails_and_its_connection_is_dropped(
    framing: str,
) -> None:
    big = b"x" * 10_000
    reply = answer(big) if framing == "content-length" else chunked(big, 1000)

    async def scenario(engines: HttptoolsEngines, url: str) -> tuple[str, bytes]:
        with pytest.raises(AnswerTooLarge) as info:
            await engines.post_read(url, b"{}", HEADERS, TIMEOUTS, limit=4096)
        _, body = await engines.post_read(url, b"{}", HEADERS, TIMEOUTS, limit=4096)
        return str(info.value), body

    (message, body), server = run([reply, answer(b'{"ok":1}')], scenario)

    assert "4096 bytes" in message and "max_answer_bytes" in message
    assert body == b'{"ok":1}'
    assert server.connections == 2  # the oversized answer's connection was not reused


def test_an_answer_at_the_read_limit_is_read() -> None:
    async def scenario(engines: HttptoolsEngines, url: str) -> bytes:
        _, body = await engines.post_read(url, b"{}", HEADERS, TIMEOUTS, limit=4096)
        return body

    body, _ = run([chunked(b"y" * 4096, 1000)], scenario)

    assert body == b"y" * 4096


def test_an_idle_connection_the_engine_closed_is_not_counted_busy() -> None:
    """The engine closes a keep-alive connection after its answer (it was
    restarted, say): the pool's busy gauge stays 0, never negative (before,
    the closed connection was still counted idle and busy went to -1)."""

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(answer(b"{}"))
        await writer.drain()
        writer.close()

    async def main() -> dict[str, int]:
        server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        engines = HttptoolsEngines(max_connections=4)
        try:
            await engines.post_read(url, b"{}", HEADERS, TIMEOUTS)
            for _ in range(500):  # until the client saw the close (hang guard: 5 s)
                if all(c.closed for p in engines._pools.values() for c in p.idle):
                    break
                await asyncio.sleep(0.01)
            return engines.tables()
        finally:
            await engines.aclose()
            server.close()

    assert asyncio.run(main()) == {"pool_waiters": 0, "pool_busy": 0}
