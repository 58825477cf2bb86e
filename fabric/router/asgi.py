"""Plain ASGI for the generation routes, the proxy's hot path.

``/v1/completions`` and ``/v1/chat/completions`` are served without
Starlette's routing, middleware, ``Request`` and ``Response`` objects
(:class:`fabric.router.app.ProxyApp` hands them their ASGI calls): the
request's few headers are read once from the scope, the body is read with
a size bound, and answers are two ``send`` calls (a stream: one per chunk).
Every other route stays on FastAPI.

Client disconnects: ASGI reports one only to whoever awaits ``receive()``.
:class:`DisconnectWatch` arms a watcher task ``WATCH_AFTER_S`` after the
request's body is read, and that task cancels the request's own task if
the client goes away. A request answered before then (a fast engine) never
creates the task; a client that leaves is noticed at most that much later.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from fabric.router.errors import INVALID_REQUEST, ProxyError, error_body

JSON = b"application/json"
WATCH_AFTER_S = 0.01


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole response to the client."""

    status: int
    body: bytes
    content_type: bytes = JSON


def error_answer(error: ProxyError) -> Answer:
    """The OpenAI-style JSON answer of ``error``."""
    return Answer(error.status, error_body(error.status, error.message, error.type, error.param))


class ClientGone(Exception):
    """The client disconnected before its request's body was read."""


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the proxy reads of a request's headers (first occurrence of each)."""

    request_id: str | None
    authorization: str | None
    content_length: int | None

    @classmethod
    def from_scope(cls, scope: Scope) -> RequestHead:
        request_id = authorization = None
        length: int | None = None
        for name, value in scope["headers"]:
            if name == b"x-request-id" and request_id is None:
                request_id = value.decode("latin-1")
            elif name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"content-length" and length is None:
                try:
                    length = int(value)
                except ValueError:
                    length = None
        return cls(request_id, authorization, length)


def body_too_large(limit: int) -> ProxyError:
    """A 413 for a body over ``proxy.max_body_bytes``."""
    return ProxyError(
        413,
        f"request body is larger than {limit} bytes (proxy.max_body_bytes)",
        INVALID_REQUEST,
    )


async def read_body(receive: Receive, head: RequestHead, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes.

    Raises a 413 ``ProxyError`` as soon as the declared length or the bytes
    received pass the limit (nothing more is buffered; the server discards
    the rest), :class:`ClientGone` on a disconnect.
    """
    if head.content_length is not None and head.content_length > limit:
        raise body_too_large(limit)
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False) and message["type"] == "http.request":
        if len(body) > limit:
            raise body_too_large(limit)
        return body
    chunks = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    if message["type"] == "http.disconnect":
        raise ClientGone
    return b"".join(chunks)


async def send_answer(send: Send, answer: Answer, request_id: str) -> None:
    """Send ``answer`` whole, with ``X-Request-Id``."""
    headers = [
        (b"content-type", answer.content_type),
        (b"content-length", b"%d" % len(answer.body)),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def send_stream(
    send: Send,
    status: int,
    content_type: bytes,
    request_id: str,
    chunks: AsyncIterator[bytes],
    before_end: Callable[[], None],
) -> None:
    """Send ``chunks`` as they come; call ``before_end()``, then end the response."""
    headers = [(b"content-type", content_type), (b"x-request-id", request_id.encode("latin-1"))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    async for chunk in chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    before_end()
    await send({"type": "http.response.body", "body": b""})


class DisconnectWatch:
    """Cancels the current task if the client disconnects (see the module docstring).

    Use as ``with DisconnectWatch(receive) as watch:``; after a
    ``CancelledError``, ``watch.gone`` tells whether this watch caused it
    (the cancel is then taken back with ``Task.uncancel``, see :meth:`absorb`).
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.gone = False

    def __enter__(self) -> DisconnectWatch:
        self._timer = self._loop.call_later(WATCH_AFTER_S, self._arm)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop watching (before the last bytes of an answer: its end reads as a disconnect)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def absorb(self) -> bool:
        """After a ``CancelledError``: True (cancel taken back) if the client left."""
        if not self.gone:
            return False
        assert self._task is not None
        self._task.uncancel()
        return True

    def _arm(self) -> None:
        self._timer = None
        self._watcher = self._loop.create_task(self._watch(), name="fabric-proxy-disconnect")

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._watcher = None
        self.gone = True
        if self._task is not None:
            self._task.cancel()
