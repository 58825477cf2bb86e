"""Relaying a decoder's answer to the client, and the errors a decoder causes.

A stream is relayed chunk by chunk as D sends it (no re-framing). Its
bookkeeping (D's outstanding count, the policy's ``on_finish``, closing D's
response) runs exactly once, however the stream ends: D finished, D failed
(the client gets an error event), the client left (Starlette cancels the
stream; closing D's response drops the connection and vLLM aborts the
request), or the stream never started.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fabric.router.engines import Engine, describe
from fabric.router.errors import UPSTREAM_ERROR, UPSTREAM_TIMEOUT, ProxyError, sse_error
from fabric.router.state import ProxyState

EVENT_STREAM = "text/event-stream"


def decode_failure(state: ProxyState, decode: Engine, exc: httpx.HTTPError) -> ProxyError:
    """The client-facing error for a failed decode; marks D down if unreachable."""
    state.counters.decode_errors += 1
    what = f"decode engine {decode.name} ({decode.url})"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        decode.mark_down(describe(exc))
        error = ProxyError(502, f"{what} is unreachable: {describe(exc)}", UPSTREAM_ERROR)
        error.retryable = True
        return error
    if isinstance(exc, httpx.TimeoutException):
        timeout = state.config.decode_timeout_s
        return ProxyError(504, f"{what} timed out after {timeout} s", UPSTREAM_TIMEOUT)
    return ProxyError(502, f"{what} failed: {describe(exc)}", UPSTREAM_ERROR)


def deadline_exceeded(state: ProxyState) -> ProxyError:
    """The client-facing error for a request past ``proxy.request_deadline_s``."""
    state.counters.deadline_exceeded += 1
    seconds = state.config.request_deadline_s
    return ProxyError(
        504,
        f"request exceeded its end-to-end deadline of {seconds:g} s (proxy.request_deadline_s)",
        UPSTREAM_TIMEOUT,
    )


async def relay_stream(
    state: ProxyState,
    prefill: Engine | None,
    decode: Engine,
    request: httpx.Request,
    deadline: float,
) -> Response:
    """Send ``request`` to D; relay its stream, or pass on its error answer whole.

    D's outstanding count, taken when D was picked, is released here. The
    stream ends with an error event once ``deadline`` (loop time) passes.
    """
    try:
        response = await state.send(request, stream=True)
    except BaseException as exc:
        decode.outstanding -= 1
        state.policy.on_finish(prefill, decode, False)
        if isinstance(exc, httpx.HTTPError):
            raise decode_failure(state, decode, exc) from exc
        raise
    relay = _Relay(state, prefill, decode, response, deadline)
    media_type = response.headers.get("content-type", EVENT_STREAM)
    if not response.is_success:
        try:
            body = await response.aread()
        except httpx.HTTPError as exc:
            raise decode_failure(state, decode, exc) from exc
        finally:
            await relay.close()
        return Response(body, response.status_code, media_type=media_type)
    return RelayResponse(relay, response.status_code, media_type)


class _Relay:
    """One open D response: its chunks, and the bookkeeping done once at the end."""

    def __init__(
        self,
        state: ProxyState,
        prefill: Engine | None,
        decode: Engine,
        response: httpx.Response,
        deadline: float,
    ) -> None:
        self.state = state
        self.prefill = prefill
        self.decode = decode
        self.response = response
        self.deadline = deadline
        self.ok = False
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """D's bytes as they arrive; an error event if D fails mid-stream or
        the deadline passes (a stalled D is bounded by the per-read timeout)."""
        loop = asyncio.get_running_loop()
        try:
            async for chunk in self.response.aiter_raw():
                if loop.time() > self.deadline:
                    error = deadline_exceeded(self.state)
                    yield sse_error(error.status, error.message, error.type)
                    return
                yield chunk
            self.ok = True
        except httpx.HTTPError as exc:
            error = decode_failure(self.state, self.decode, exc)
            yield sse_error(error.status, error.message, error.type)

    async def close(self) -> None:
        """Count the request finished and close D's response (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.decode.outstanding -= 1
        self.state.policy.on_finish(self.prefill, self.decode, self.ok)
        # NOTE: shielded: after a client disconnect this runs inside a
        # cancelled scope, where an unshielded await would be cancelled too.
        with anyio.CancelScope(shield=True):
            await self.response.aclose()


class RelayResponse(StreamingResponse):
    """A streaming response that closes its relay however the stream ends."""

    def __init__(self, relay: _Relay, status_code: int, media_type: str) -> None:
        super().__init__(relay.chunks(), status_code, media_type=media_type)
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream, then close the relay (also on disconnect or error)."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._relay.close()
