"""Relaying a decoder's answer to the client, and the errors a decoder causes.

A stream is relayed chunk by chunk as D sends it (no re-framing). Its
bookkeeping (D's outstanding count, the policy's ``on_finish``, closing D's
response) runs exactly once, however the stream ends: D finished, D failed
(the client gets an error event), the client left (the disconnect watch
cancels the request's task; closing D's response drops the connection and
vLLM aborts the request), D became unreachable (its reads are cut, see
:mod:`fabric.router.calls`: an error event), or the stream never started.
Open relays are the ``streams`` table of
:meth:`fabric.router.state.ProxyState.tables`.

Decoder errors reach the client as OpenAI-style JSON: 502 (unreachable,
became unreachable, failed, or an answer past ``max_answer_bytes``), 503
(no free pooled connection to it in time, or it is draining) or 504
(timed out). Those where nothing reached D (unreachable, no free
connection, its drain gate's refusal) are ``retryable``:
:mod:`fabric.router.pd` sends the request to another decoder first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from fabric.router.asgi import Answer
from fabric.router.calls import Call, EngineUnreachable
from fabric.router.engines import Engine, describe, is_drain_refusal
from fabric.router.errors import (
    UNAVAILABLE,
    UPSTREAM_ERROR,
    UPSTREAM_TIMEOUT,
    ProxyError,
    sse_error,
)
from fabric.router.first_token import FirstToken, Mismatch, Splice, continuation
from fabric.router.requests import dump_json
from fabric.router.state import ProxyState
from fabric.router.transport import AnswerTooLarge, EngineResponse, Timeouts

EVENT_STREAM = b"text/event-stream"


def count_transport_error(state: ProxyState, exc: httpx.HTTPError) -> None:
    """Count the engine call failures that have counters of their own."""
    if isinstance(exc, httpx.PoolTimeout):
        state.counters.pool_timeouts += 1
    elif isinstance(exc, AnswerTooLarge):
        state.counters.answers_too_large += 1


def decode_failure(state: ProxyState, decode: Engine, exc: httpx.HTTPError) -> ProxyError:
    """The client-facing error for a failed decode; marks D down if unreachable."""
    state.counters.decode_errors += 1
    count_transport_error(state, exc)
    what = f"decode engine {decode.name} ({decode.url})"
    if isinstance(exc, httpx.PoolTimeout):  # NOTE: raised before anything is sent
        error = ProxyError(503, f"{what}: {exc}", UNAVAILABLE)
        error.retryable = True
        return error
    if isinstance(exc, AnswerTooLarge):
        return ProxyError(
            502,
            f"{what} answered more than {exc.limit} bytes (proxy.max_answer_bytes); "
            "the answer was dropped",
            UPSTREAM_ERROR,
        )
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        state.connect_failed(decode, exc)
        error = ProxyError(502, f"{what} is unreachable: {describe(exc)}", UPSTREAM_ERROR)
        error.retryable = True
        return error
    if isinstance(exc, EngineUnreachable):
        return ProxyError(502, f"{what} became unreachable: {exc}", UPSTREAM_ERROR)
    if isinstance(exc, httpx.TimeoutException):
        timeout = state.config.decode_timeout_s
        return ProxyError(504, f"{what} timed out after {timeout} s", UPSTREAM_TIMEOUT)
    return ProxyError(502, f"{what} failed: {describe(exc)}", UPSTREAM_ERROR)


def check_drain_refusal(state: ProxyState, decode: Engine, status: int, payload: bytes) -> None:
    """Raise a retryable 503 if D's error answer is its drain gate's refusal
    (D is marked draining at once: nothing new is sent there)."""
    if not is_drain_refusal(status, payload):
        return
    state.counters.drain_refusals += 1
    decode.saw_draining()
    error = ProxyError(503, f"decode engine {decode.name} ({decode.url}) is draining", UNAVAILABLE)
    error.retryable = True
    raise error


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
    url: str,
    content: bytes,
    headers: dict[str, str],
    deadline: float,
    timeouts: Timeouts | None = None,
    first: FirstTokenWait | None = None,
) -> Relay | Answer:
    """POST to D; a :class:`Relay` of its stream, or its error answer whole
    (``timeouts``: default the proxy's decode timeouts; ``first``: P's
    first token goes first, see :mod:`fabric.router.first_token`).

    D's outstanding count, taken when D was picked, is released here or by
    the relay's :meth:`Relay.close`. The stream ends with an error event
    once ``deadline`` (loop time) passes, or once D becomes unreachable.
    """
    call = decode.calls.open()
    try:
        with call:
            response = await state.engines.post(
                url, content, headers, timeouts or state.decode_timeouts
            )
    except BaseException as exc:
        call.close()
        decode.outstanding -= 1
        state.policy.on_finish(prefill, decode, False)
        if isinstance(exc, httpx.HTTPError):
            raise decode_failure(state, decode, exc) from exc
        raise
    relay = Relay(state, prefill, decode, response, deadline, call, first)
    relay.again = (url, headers)  # NOTE: first_token: to ask D again
    if response.is_success:
        return relay
    try:
        with call:
            body = await response.read(state.max_answer_bytes)
    except httpx.HTTPError as exc:
        raise decode_failure(state, decode, exc) from exc
    finally:
        await relay.close()
    check_drain_refusal(state, decode, response.status, body)
    return Answer(response.status, body, relay.content_type)


def _retrieve(task: asyncio.Task[bytes | None]) -> None:
    """Mark a dropped read's exception retrieved (D's response is closed anyway)."""
    if not task.cancelled():
        task.exception()


async def _read(chunks: AsyncIterator[bytes]) -> bytes | None:
    """The next chunk, or None at the end."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


@dataclass(frozen=True)
class FirstTokenWait:
    """P's first token, set by the prefill leg (None: D's goes first), and
    whether the client asked for token ids."""

    future: asyncio.Future[FirstToken | None]
    want_ids: bool
    body: dict[str, Any]  # the client's: to continue from P's token


class Relay:
    """One open D response: its chunks, and the bookkeeping done once at the end."""

    def __init__(
        self,
        state: ProxyState,
        prefill: Engine | None,
        decode: Engine,
        response: EngineResponse,
        deadline: float,
        call: Call,
        first: FirstTokenWait | None = None,
    ) -> None:
        self.state = state
        self.prefill = prefill
        self.decode = decode
        self.response = response
        self.deadline = deadline
        self.call = call  # D's reads, cut if D becomes unreachable
        self.status = response.status
        content_type = response.content_type
        self.content_type = content_type.encode("latin-1") if content_type else EVENT_STREAM
        self.first = first
        self.ok = False
        self._closed = False
        self._pending: asyncio.Task[bytes | None] | None = None  # a read raced against P
        self.again: tuple[str, dict[str, str]] | None = None  # D's url, headers
        state.streams += 1

    async def chunks(self) -> AsyncIterator[bytes]:
        """D's bytes as they arrive; an error event if D fails mid-stream, the
        deadline passes or D becomes unreachable (a stalled D is bounded by
        the per-read timeout)."""
        loop = asyncio.get_running_loop()
        call = self.call
        source = self.response.chunks()
        if self.first is not None:
            source = self._spliced(source, self.first)
        try:
            with call:
                async for chunk in source:
                    call.reading = False  # NOTE: the send to the client is never cut
                    if loop.time() > self.deadline:
                        error = deadline_exceeded(self.state)
                        yield sse_error(error.status, error.message, error.type)
                        return
                    yield chunk
                    call.resume()
            self.ok = True
        except httpx.HTTPError as exc:
            error = decode_failure(self.state, self.decode, exc)
            yield sse_error(error.status, error.message, error.type)
        except Mismatch as exc:
            yield sse_error(502, str(exc), UPSTREAM_ERROR)

    async def _spliced(
        self, source: AsyncIterator[bytes], first: FirstTokenWait
    ) -> AsyncIterator[bytes]:
        """D's chunks, with P's first token sent before them when it comes
        first (see :mod:`fabric.router.first_token`).

        NOTE: until P's token or D's first token is in, D's next chunk is
        read in a task raced against P's answer; only one read is ever
        pending, and it is cancelled if the stream ends first, here or in
        :meth:`close`. Any event of D's before its first token (an error)
        ends the race: P's token never follows it.
        """
        loop = asyncio.get_running_loop()
        splice = Splice(first.want_ids)
        reads = aiter(source)
        waiting = True  # neither token is in
        decode_first = False  # D's token goes first (P's answer is not usable): counted when in
        try:
            while True:
                if waiting and not first.future.done():
                    if self._pending is None:
                        self._pending = asyncio.create_task(_read(reads))
                    await asyncio.wait(
                        (self._pending, first.future), return_when=asyncio.FIRST_COMPLETED
                    )
                ready = self._pending is not None and self._pending.done()
                if waiting and first.future.done() and not ready:
                    # NOTE: a read of D's that is ready too goes first (D's token may be in it)
                    waiting = False
                    token = first.future.result()
                    if token is None:
                        decode_first = True
                    else:
                        splice.sent_first(token)
                        self.state.counters.first_tokens_from_prefill += 1
                        yield token.event(first.want_ids)
                read, self._pending = self._pending, None
                # NOTE: P's token (if any) went out; D's read is awaited
                chunk = await (read if read is not None else _read(reads))
                if chunk is None:
                    break
                was_joined = splice.joined
                try:
                    events = splice.feed(chunk)
                except Mismatch:
                    if splice.first is not None:  # NOTE: D's own first token did come
                        self.state.first_token_lag(loop.time() - splice.first.at)
                    again = await self._continue(first, splice.first)
                    if again is None:
                        raise
                    reads, splice = again, Splice(first.want_ids, after=splice.first)
                    continue
                if splice.ended_on_other:  # NOTE: D's one-token answer: P's token is the answer
                    self.state.counters.first_token_mismatches += 1
                    splice.ended_on_other = False
                if waiting and events:  # NOTE: D's token (or an error) came before P's answer
                    waiting, decode_first = False, splice.joined
                if splice.joined and not was_joined:
                    if splice.first is not None:
                        self.state.first_token_lag(loop.time() - splice.first.at)
                    elif decode_first:
                        self.state.counters.first_tokens_from_decode += 1
                for event in events:
                    yield event
            if rest := splice.rest():
                if splice.first is not None and not splice.joined:
                    # NOTE: not framed as vLLM frames events: D's first token cannot be checked
                    self.state.counters.first_token_mismatches += 1
                    raise Mismatch(
                        "the decoder's stream ended inside an event before its first token"
                    )
                yield rest
        finally:
            self._drop_pending()

    async def _continue(
        self, first: FirstTokenWait, token: FirstToken | None
    ) -> AsyncIterator[bytes] | None:
        """Drop D's request whose first token was not P's and ask D for the
        answer after P's token (see :mod:`fabric.router.first_token`); its
        chunks, or None if it cannot be asked. Raises :class:`Mismatch` if
        D refuses it (httpx errors go on as D's failures)."""
        self.state.counters.first_token_mismatches += 1
        if token is None:
            return None
        body = continuation(first.body, token)
        if body is None or self.again is None:
            return None
        if asyncio.get_running_loop().time() > self.deadline:
            return None
        self._drop_pending()
        url, headers = self.again
        # NOTE: it waits for no prefill: the decode timeouts, not an early handoff's
        timeouts = self.state.decode_timeouts
        await self.response.close()  # NOTE: vLLM aborts a request whose connection closes
        headers = {**headers, "x-request-id": f"{headers.get('x-request-id', '')}-p1"}
        response = await self.state.engines.post(url, dump_json(body), headers, timeouts)
        self.response = response
        if not response.is_success:
            payload = await response.read(self.state.max_answer_bytes)
            self.state.counters.decode_errors += 1
            if is_drain_refusal(response.status, payload):
                self.state.counters.drain_refusals += 1
                self.decode.saw_draining()
            raise Mismatch(
                f"the decoder's first token was not the prefiller's, and asked for the rest "
                f"after it, it answered HTTP {response.status}: "
                f"{payload[:200].decode(errors='replace')}"
            )
        self.state.counters.first_token_continuations += 1
        return aiter(response.chunks())

    def _drop_pending(self) -> None:
        """Cancel a read of D's still raced against P's answer (its outcome retrieved)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.done():
            _retrieve(pending)
        else:
            pending.cancel()
            pending.add_done_callback(_retrieve)

    async def close(self) -> None:
        """Count the request finished and close D's response (idempotent).

        NOTE: also runs in a ``finally`` block after the disconnect watch
        cancelled the task: asyncio delivers a cancel once, so this await
        completes.
        """
        if self._closed:
            return
        self._closed = True
        self._drop_pending()
        self.call.close()
        self.state.streams -= 1
        self.decode.outstanding -= 1
        self.state.policy.on_finish(self.prefill, self.decode, self.ok)
        await self.response.close()
