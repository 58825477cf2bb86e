"""An httpx transport over aiohttp's connection pool, for the proxy's engine traffic.

The proxy keeps httpx's API (one shared ``httpx.AsyncClient``, its timeouts
and exceptions) but not httpcore's pool: on every pool event httpcore walks
every connection and polls each idle socket, so its CPU cost per request
grows with concurrency (``notes/peers.md``: 18-21% of a Python PD proxy's
time). aiohttp keeps idle connections per host in O(1) structures and parses
HTTP in C. Measured here (fake engines answering at once, non-streaming, a
Python load generator on the same 2 cores): proxy CPU per request 2.3 ms at
1 client rising to 6.1 ms at 16-32 clients on httpcore's pool; 1.1-1.5 ms,
flat, on this transport (with requests built directly, see
``ProxyState.engine_request``); a bare aiohttp + Starlette proxy ~0.9 ms.

Errors are translated at the boundary into the httpx exceptions the rest of
the proxy handles: ``ConnectError``/``ConnectTimeout`` (the engine is
unreachable), ``ReadTimeout``, ``ReadError``/``RemoteProtocolError``.
``open_transport()`` returns None when aiohttp is not installed; the client
then uses httpx's own transport.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import aiohttp


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Sends httpx requests through one ``aiohttp.ClientSession``."""

    def __init__(self, max_connections: int) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        # NOTE: raw bytes both ways (no decompression, no auto headers): the
        # proxy relays what engines send and asks for identity encoding.
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            trust_env=False,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; the response body streams from the open connection."""
        timeout = _timeout(self._aiohttp, request.extensions.get("timeout", {}))
        try:
            response = await self._session.request(
                request.method,
                str(request.url),
                headers=list(request.headers.multi_items()),
                data=await request.aread(),
                timeout=timeout,
                allow_redirects=False,
            )
        except Exception as exc:
            translated = _translate(self._aiohttp, exc, request)
            if translated is None:
                raise
            raise translated from exc
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(self._aiohttp, response, request),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._session.close()


class _Body(httpx.AsyncByteStream):
    """An aiohttp response body as an httpx stream; closing it frees the connection."""

    def __init__(
        self, aiohttp_module: Any, response: aiohttp.ClientResponse, request: httpx.Request
    ) -> None:
        self._aiohttp = aiohttp_module
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except Exception as exc:
            translated = _translate(self._aiohttp, exc, self._request)
            if translated is None:
                raise
            raise translated from exc

    async def aclose(self) -> None:
        # NOTE: a body not read to its end leaves the connection unusable:
        # close it (the engine sees the disconnect and aborts the request).
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()


def open_transport(max_connections: int) -> httpx.AsyncBaseTransport | None:
    """The aiohttp-backed transport, or None when aiohttp is not installed."""
    try:
        return AiohttpTransport(max_connections)
    except ImportError:
        return None


def _timeout(aiohttp_module: Any, timeout: dict[str, float | None]) -> aiohttp.ClientTimeout:
    """httpx's per-request timeouts as aiohttp's: connect, then each socket read."""
    connect = timeout.get("connect")
    return aiohttp_module.ClientTimeout(
        total=None, connect=connect, sock_connect=connect, sock_read=timeout.get("read")
    )


def _translate(
    aiohttp_module: Any, exc: Exception, request: httpx.Request
) -> httpx.TransportError | None:
    """The httpx exception that stands for an aiohttp failure (None: not one)."""
    errors = aiohttp_module
    message = str(exc) or type(exc).__name__
    # NOTE: order matters: ConnectionTimeoutError is also a TimeoutError and an OSError.
    translated: httpx.TransportError
    if isinstance(exc, errors.ConnectionTimeoutError):
        translated = httpx.ConnectTimeout(message, request=request)
    elif isinstance(exc, errors.ClientConnectorError):
        translated = httpx.ConnectError(message, request=request)
    elif isinstance(exc, TimeoutError):
        translated = httpx.ReadTimeout(message, request=request)
    elif isinstance(exc, errors.ServerDisconnectedError | errors.ClientPayloadError):
        translated = httpx.RemoteProtocolError(message, request=request)
    elif isinstance(exc, errors.ClientError | OSError):
        translated = httpx.ReadError(message, request=request)
    else:
        return None
    return translated
