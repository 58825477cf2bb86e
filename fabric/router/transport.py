"""HTTP to the engines: the small client interface the PD flow calls.

The proxy's two engine calls per request (P, then D) go through
:class:`EngineHTTP`: ``post(url, content, headers, timeouts)`` returns an
:class:`EngineResponse` whose body is read whole (``read``) or streamed
(``chunks``). Nothing else rides on the hot path: no ``httpx.Request`` /
``httpx.Response`` objects, no header model conversions. The one
implementation is :class:`fabric.router.pool.HttptoolsEngines`, a small
keep-alive pool on asyncio protocols and httptools' C parser; health
probes and admin routes use a plain ``httpx.AsyncClient``
(:func:`fabric.router.pool.open_engines` makes both).

Why that pool: measured here (``benchmarks/proxy.py``'s fake engines, 32
clients, the load generator on the same 2 cores; proxy CPU per proxied
request, ``benchmarks/results/proxy-2026-11-29.json``): httpx's own pool
(httpcore) 2.3 -> 6.1 ms from 1 to 32 clients (it walks and polls every
connection on each pool event); httpx objects over aiohttp ~0.8 ms;
aiohttp called directly ~0.45 ms; the httptools pool ~0.2 ms. The aiohttp
and httpx engine clients were dropped after that measurement.

Errors are raised as httpx's exceptions, which the rest of the proxy
handles (and which the ``httpx.AsyncClient`` of health probes and admin
routes raises too): ``ConnectError`` / ``ConnectTimeout`` (the engine is
unreachable), ``PoolTimeout`` (no free pooled connection within
``Timeouts.pool``), ``ReadTimeout``, ``ReadError`` /
``RemoteProtocolError``, and :class:`AnswerTooLarge` (a body read whole
passed its limit; the connection is dropped, never reused).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx

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
