"""HTTP to the engines: one small client interface over three pools.

The proxy's two engine calls per request (P, then D) go through
:class:`EngineHTTP`: ``post(url, content, headers, timeouts)`` returns an
:class:`EngineResponse` whose body is read whole (``read``) or streamed
(``chunks``). Nothing else rides on the hot path: no ``httpx.Request`` /
``httpx.Response`` objects, no header model conversions. Backends
(``proxy.http_pool``):

- ``httptools`` (default): :class:`fabric.router.pool.HttptoolsEngines`, a
  small keep-alive pool on asyncio protocols and httptools' C parser.
- ``aiohttp``: :class:`AiohttpEngines`; aiohttp keeps idle connections per
  host in O(1) structures and parses HTTP in C, but builds a request and
  response object tree per call.
- ``httpx``: :class:`HttpxEngines`, httpx's own transport. httpcore's pool
  walks and polls every connection on each pool event, so its CPU cost per
  request grows with concurrency (profiles of Python PD proxies put it at
  18-21% of their time).

Measured here (``benchmarks/proxy.py``'s fake engines, 32 clients, the load
generator on the same 2 cores; proxy CPU per proxied request): httpcore's
pool 2.3 -> 6.1 ms from 1 to 32 clients; httpx objects over aiohttp ~0.8 ms;
aiohttp called directly ~0.45 ms; the httptools pool ~0.2 ms.

Errors are translated at the boundary into httpx's exceptions, which the
rest of the proxy handles (and which the ``httpx.AsyncClient`` used for
health probes and admin routes raises too): ``ConnectError`` /
``ConnectTimeout`` (the engine is unreachable), ``PoolTimeout`` (no free
pooled connection within ``Timeouts.pool``: httptools and httpx; aiohttp
counts that wait in its connect timeout), ``ReadTimeout``, ``ReadError`` /
``RemoteProtocolError``, and :class:`AnswerTooLarge` (a body read whole
passed its limit; the connection is dropped, never reused). That client
runs over aiohttp (:class:`AiohttpTransport`) when it is installed.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import aiohttp

KEEPALIVE_S = 4.0
"""How long an idle engine connection is kept.

NOTE: below the engines' own idle timeout (uvicorn's and vLLM's: 5 s): a
connection the server has just closed would otherwise be picked for the
next request, which then fails ("Can not write request body").
"""


@dataclass(frozen=True)
class Timeouts:
    """Bounds of one engine call: connecting, each wait for bytes, and the
    wait for a free pooled connection (None: ``connect``)."""

    connect: float
    read: float
    pool: float | None = None

    @property
    def pool_s(self) -> float:
        return self.connect if self.pool is None else self.pool


class AnswerTooLarge(httpx.TransportError):
    """An engine's answer, read whole, is larger than the limit the proxy keeps in memory."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the answer is larger than {limit} bytes (proxy.max_answer_bytes)")
        self.limit = limit


def check_length(content_length: str | int | None, limit: int | None) -> None:
    """AnswerTooLarge when a declared ``Content-Length`` passes ``limit``."""
    if limit is None or content_length is None:
        return
    try:
        length = int(content_length)
    except ValueError:
        return
    if length > limit:
        raise AnswerTooLarge(limit)


class EngineResponse(abc.ABC):
    """An engine's answer whose body has not been read yet.

    Either ``read()`` it whole or iterate ``chunks()``; ``close()`` always
    (idempotent): a body not read to its end closes the connection, and the
    engine sees the disconnect and aborts the request.
    """

    status: int
    content_type: str | None

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    @abc.abstractmethod
    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; the connection goes back to the pool. Past
        ``limit`` bytes: :class:`AnswerTooLarge` (``close()`` then drops the
        connection)."""

    @abc.abstractmethod
    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection (or drop it when the body was not read to its end)."""


class EngineHTTP(abc.ABC):
    """POSTs to engines; raises httpx's transport exceptions."""

    pool_name = ""  # the ``proxy.http_pool`` value it implements

    @abc.abstractmethod
    async def post(
        self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> EngineResponse:
        """Send ``content``; return once the status line and headers are in."""

    async def post_read(
        self,
        url: str,
        content: bytes,
        headers: Mapping[str, str],
        timeouts: Timeouts,
        limit: int | None = None,
    ) -> tuple[EngineResponse, bytes]:
        """:meth:`post`, then the whole body (at most ``limit`` bytes)."""
        response = await self.post(url, content, headers, timeouts)
        try:
            return response, await response.read(limit)
        finally:
            await response.close()

    def tables(self) -> dict[str, int]:
        """Sizes of its per-call state (calls waiting for a connection, ...)."""
        return {}

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every pooled connection."""


# --- aiohttp ------------------------------------------------------------------


class AiohttpEngines(EngineHTTP):
    """Engine calls on one ``aiohttp.ClientSession``."""

    pool_name = "aiohttp"

    def __init__(self, max_connections: int) -> None:
        import aiohttp
        import yarl

        self._aiohttp = aiohttp
        self._yarl = yarl
        # NOTE: raw bytes both ways (no decompression, no auto headers): the
        # proxy relays what engines send and asks for identity encoding.
        connector = aiohttp.TCPConnector(
            limit=max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            trust_env=False,
        )
        self._urls: dict[str, Any] = {}  # str -> yarl.URL, parsed once
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}

    async def post(
        self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> EngineResponse:
        """POST over the pool; aiohttp's failures raised as httpx's."""
        try:
            response = await self.session.request(
                "POST",
                self._url(url),
                data=content,
                headers=headers,
                timeout=self._timeout(timeouts),
                allow_redirects=False,
            )
        except Exception as exc:
            raise _translated(self._aiohttp, exc) from exc
        return _AiohttpResponse(self._aiohttp, response)

    async def aclose(self) -> None:
        await self.session.close()

    def _url(self, url: str) -> Any:
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = self._yarl.URL(url)
        return parsed

    def _timeout(self, timeouts: Timeouts) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(timeouts)
        if timeout is None:
            timeout = self._timeouts[timeouts] = _client_timeout(
                self._aiohttp, timeouts.connect, timeouts.read
            )
        return timeout


class _AiohttpResponse(EngineResponse):
    __slots__ = ("_aiohttp", "_response", "content_type", "status")

    def __init__(self, aiohttp_module: Any, response: aiohttp.ClientResponse) -> None:
        self._aiohttp = aiohttp_module
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("Content-Type")

    async def read(self, limit: int | None = None) -> bytes:
        try:
            if limit is None:
                return await self._response.read()
            check_length(self._response.headers.get("Content-Length"), limit)
            parts, size = [], 0
            async for chunk in self._response.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise AnswerTooLarge(limit)
                parts.append(chunk)
            return b"".join(parts)
        except AnswerTooLarge:
            raise
        except Exception as exc:
            raise _translated(self._aiohttp, exc) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except Exception as exc:
            raise _translated(self._aiohttp, exc) from exc

    async def close(self) -> None:
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport over :class:`AiohttpEngines`' session (probes, admin routes).

    ``owned``: closing the transport closes the session (else the engine
    client it also serves closes it).
    """

    def __init__(self, engines: AiohttpEngines, *, owned: bool) -> None:
        self._engines = engines
        self._owned = owned

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; the response body streams from the open connection."""
        aiohttp = self._engines._aiohttp
        timeout = request.extensions.get("timeout", {})
        try:
            response = await self._engines.session.request(
                request.method,
                str(request.url),
                headers=list(request.headers.multi_items()),
                data=await request.aread(),
                timeout=_client_timeout(aiohttp, timeout.get("connect"), timeout.get("read")),
                allow_redirects=False,
            )
        except Exception as exc:
            raise _translated(aiohttp, exc, request) from exc
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_HttpxBody(_AiohttpResponse(aiohttp, response)),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._owned:
            await self._engines.aclose()


class _HttpxBody(httpx.AsyncByteStream):
    def __init__(self, response: EngineResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.chunks():
            yield chunk

    async def aclose(self) -> None:
        await self._response.close()


def _client_timeout(
    aiohttp_module: Any, connect: float | None, read: float | None
) -> aiohttp.ClientTimeout:
    """Connect, then each socket read, bounded; no bound on the whole exchange."""
    return aiohttp_module.ClientTimeout(
        total=None, connect=connect, sock_connect=connect, sock_read=read
    )


def _translated(
    aiohttp_module: Any, exc: Exception, request: httpx.Request | None = None
) -> Exception:
    """The httpx exception that stands for an aiohttp failure (``exc`` itself: not one)."""
    errors = aiohttp_module
    message = str(exc) or type(exc).__name__
    # NOTE: order matters: ConnectionTimeoutError is also a TimeoutError and an OSError.
    if isinstance(exc, errors.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, errors.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, errors.ServerDisconnectedError | errors.ClientPayloadError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, errors.ClientError | OSError):
        return httpx.ReadError(message, request=request)
    return exc


# --- httpx --------------------------------------------------------------------


class HttpxEngines(EngineHTTP):
    """Engine calls straight to an httpx transport (its own pool).

    NOTE: ``AsyncClient.send`` adds auth, redirect, cookie-jar and event-hook
    handling that engine requests never use (~40% of the proxy's CPU per
    request, cProfile); the transport alone is enough.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._transport = transport
        self._urls: dict[str, httpx.URL] = {}
        self._extensions: dict[Timeouts, dict[str, Any]] = {}

    async def post(
        self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> EngineResponse:
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = httpx.URL(url)
        extensions = self._extensions.get(timeouts)
        if extensions is None:
            timeout = httpx.Timeout(timeouts.read, connect=timeouts.connect, pool=timeouts.pool_s)
            extensions = self._extensions[timeouts] = {"timeout": timeout.as_dict()}
        request = httpx.Request(
            "POST", parsed, content=content, headers=headers, extensions=extensions
        )
        return _HttpxResponse(await self._transport.handle_async_request(request))

    async def aclose(self) -> None:
        """Nothing: the transport belongs to the proxy's ``httpx.AsyncClient``."""


class _HttpxResponse(EngineResponse):
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.content_type = response.headers.get("content-type")

    async def read(self, limit: int | None = None) -> bytes:
        if limit is None:
            return await self._response.aread()
        check_length(self._response.headers.get("content-length"), limit)
        parts, size = [], 0
        async for chunk in self._response.aiter_raw():
            size += len(chunk)
            if size > limit:
                raise AnswerTooLarge(limit)
            parts.append(chunk)
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_raw():
            yield chunk

    async def close(self) -> None:
        await self._response.aclose()
