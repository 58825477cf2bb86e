"""The PD flow of one generation request.

Early handoff (``proxy.handoff: early``, the default; see
:mod:`fabric.router.handoff`)::

    client --body--> proxy
                       | pick (P, D) by policy; transfer_id = uuid4().hex
                       | (CLIENT_ID-xxxxxxxx if the client sent X-Request-Id)
                       |--- body + max_tokens=1, stream=false,
                       |    kv_transfer_params{do_remote_decode, transfer_id,
                       |    decode_kv_endpoint=D} --------------------------> P
                       |--- at once: body + kv_transfer_params{do_remote_
                       |    prefill, transfer_id} -------------------------> D
                       |<-- P's answer: only success or an error (told to D)
    client <-----------|<-- JSON or SSE stream, relayed as it comes -------- D

Sequential (``handoff: sequential``, or when D holds ``early_max_tokens``
already)::

                       |--- body + max_tokens=1 ... ------------------------> P
                       |<-- {..., kv_transfer_params: {...}} ---------------- P
                       |--- body + P's kv_transfer_params -----------------> D
    client <-----------|<-- JSON or SSE stream, relayed as it comes -------- D

In the early flow a failed prefill (the same failures as below) is told
to D at once, which recomputes the prompt (a fallback); the prefill leg
runs beside D's and is cancelled (P aborts it) when the request ends
before it, however it ends.

If the prefill fails (unreachable, timeout, non-2xx, no free connection,
an answer past ``max_answer_bytes``) or P returns no ``kv_transfer_params``,
D gets the body without params and computes the prompt itself; the
fallback is logged and counted. The same happens when no prefiller may
serve with the chosen D (none healthy, all draining, or every pair with D
failed its canary, see :mod:`fabric.router.ready`). A decoder failure is
an OpenAI-style JSON error (see :mod:`fabric.router.relay`); after a
stream has started, an error event ends it. When every decoder is
draining (also when the last ones start draining while the prefix hints
are looked up), the request gets a 503 at once.

A decoder that got nothing of the request (unreachable, no free pooled
connection in time, or its drain gate refused it with a 503, which marks
it draining at once) is replaced by another routable decoder, each decoder
tried once: that one computes the prompt itself (the KV P pushed went to
the first one: counted as a fallback).

Each request is in ``state.requests`` (the ``requests`` table) from its
arrival until its answer ends, however it ends.

A prompt shorter than ``disaggregate_min_prompt_tokens`` skips P: D gets the
body without params and computes it (counted as a local decode). P and D get
the transfer id as ``X-Request-Id``.

Every request has an end-to-end deadline (``proxy.request_deadline_s``):
past it, the flow is cancelled like a disconnect and the client gets a 504
JSON error, or, once a stream is being relayed, an error event that ends
it (counted as ``deadline_exceeded``).

A client that disconnects before its answer starts cancels the whole flow:
the requests to P and D are dropped (vLLM aborts a request whose connection
closes), nothing more is sent, and it is counted (``client_disconnects``).
Once a stream is being relayed, the same watch ends it and the relay closes
D's response (see :mod:`fabric.router.relay`). The request is served as a
plain ASGI call (see :mod:`fabric.router.asgi` for why, and for how the
disconnect is noticed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Container
from typing import Any
from uuid import uuid4

import httpx
from starlette.types import Receive, Scope, Send

from fabric.router.asgi import (
    Answer,
    ClientGone,
    DisconnectWatch,
    RequestHead,
    error_answer,
    read_body,
    send_answer,
    send_stream,
)
from fabric.router.engines import Engine, describe, is_drain_refusal
from fabric.router.errors import INTERNAL, UNAVAILABLE, ProxyError, error_body
from fabric.router.first_token import FirstToken, eligible
from fabric.router.handoff import early_params
from fabric.router.prefix import body_identity, lookup_all, prompt_token_ids
from fabric.router.relay import (
    FirstTokenWait,
    Relay,
    check_drain_refusal,
    count_transport_error,
    deadline_exceeded,
    decode_failure,
    relay_stream,
)
from fabric.router.requests import (
    Endpoint,
    decode_body,
    decode_content,
    dump_json,
    estimate_prompt_tokens,
    is_stream,
    load_json,
    parse_body,
    prefill_body,
)
from fabric.router.state import InFlight, ProxyState
from fabric.router.transport import Timeouts

logger = logging.getLogger(__name__)

JSON = b"application/json"
UNKNOWN_CAPACITY_EARLY = 16
"""Early handoffs a decoder holds at once while its KV size is unknown
(and ``early_max_tokens`` is 0)."""
MAX_CLIENT_ID = 128


async def serve_generation(
    state: ProxyState, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
) -> None:
    """Answer one completion/chat request (an ASGI call) through a prefiller and a decoder.

    The answer (errors too) carries ``X-Request-Id``: the client's, or the
    transfer id when the client sent none.
    """
    state.counters.requests += 1
    head = RequestHead.from_scope(scope)
    transfer_id = new_transfer_id(head.request_id, state.requests)
    record = state.requests[transfer_id] = InFlight(
        endpoint.path, asyncio.get_running_loop().time()
    )
    try:
        await _serve_request(state, endpoint, head, transfer_id, record, receive, send)
    finally:
        _cancel_early(record)
        if state.requests.get(transfer_id) is record:
            del state.requests[transfer_id]


async def _serve_request(
    state: ProxyState,
    endpoint: Endpoint,
    head: RequestHead,
    transfer_id: str,
    record: InFlight,
    receive: Receive,
    send: Send,
) -> None:
    request_id = head.request_id or transfer_id
    try:
        raw = await read_body(receive, head, state.config.max_body_bytes)
    except ProxyError as exc:
        state.counters.client_errors += 1
        await send_answer(send, error_answer(exc), request_id)
        return
    except ClientGone:
        state.counters.client_disconnects += 1
        return
    with DisconnectWatch(receive) as watch:
        try:
            result = await _flow(state, endpoint, head, raw, transfer_id, record)
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
            state.counters.client_disconnects += 1
            logger.info("%s: the client disconnected; prefill/decode requests dropped", transfer_id)
            return
        try:
            await _send_result(send, result, request_id, watch)
        except asyncio.CancelledError:
            if not watch.absorb():  # else: the client left mid-answer; D's response is closed
                raise


def new_transfer_id(client_id: str | None, taken: Container[str] = ()) -> str:
    """A unique id for P and D (vLLM's request id): the client's id plus a
    suffix, never one in ``taken`` (the requests in flight).

    NOTE: clients may reuse ids; P and D need unique ones, hence the suffix
    (64 random bits: a decoder refuses a Reserve for a transfer id it released
    in the last 40 s; two requests in flight may still draw the same, so it is
    drawn again then).
    """
    while True:
        transfer_id = (
            f"{client_id[:MAX_CLIENT_ID]}-{uuid4().hex[:16]}" if client_id else uuid4().hex
        )
        if transfer_id not in taken:
            return transfer_id


async def _flow(
    state: ProxyState,
    endpoint: Endpoint,
    head: RequestHead,
    raw: bytes,
    transfer_id: str,
    record: InFlight,
) -> Answer | Relay:
    """The PD flow within the request's deadline; failures as OpenAI-style answers."""
    deadline = asyncio.get_running_loop().time() + state.config.request_deadline_s
    try:
        async with asyncio.timeout_at(deadline):
            return await _serve(state, endpoint, head, raw, transfer_id, deadline, record)
    except TimeoutError:
        return error_answer(deadline_exceeded(state))
    except ProxyError as exc:
        return error_answer(exc)
    except Exception as exc:
        logger.exception("proxy error on POST %s", endpoint.path)
        return Answer(500, error_body(500, f"proxy error: {describe(exc)}", INTERNAL))


async def _send_result(
    send: Send, result: Answer | Relay, request_id: str, watch: DisconnectWatch
) -> None:
    """Send an answer whole, or relay a stream (closing it however that ends)."""
    if isinstance(result, Answer):
        watch.stop()  # NOTE: the answer's end would read as a disconnect
        await send_answer(send, result, request_id)
        return
    try:
        await send_stream(
            send, result.status, result.content_type, request_id, result.chunks(), watch.stop
        )
    finally:
        await result.close()


async def _serve(
    state: ProxyState,
    endpoint: Endpoint,
    head: RequestHead,
    raw: bytes,
    transfer_id: str,
    deadline: float,
    record: InFlight,
) -> Answer | Relay:
    try:
        body = parse_body(raw, endpoint)
    except ProxyError:
        state.counters.client_errors += 1
        raise
    local = _too_short(state, body, endpoint)
    prefillers = [] if local else state.pool.healthy_prefillers()
    decoders = _candidate_decoders(state)
    hints = await _prefix_hints(state, body, endpoint, [*prefillers, *decoders])
    # NOTE: engines may have started draining during the lookups
    decoders = [e for e in decoders if not e.draining] or _candidate_decoders(state)
    prefill, decode = state.policy.pick(prefillers, decoders, body, hints, state.readiness.rank)
    record.prefill = prefill.name if prefill is not None else None
    record.decode = decode.name
    headers = _forward_headers(head, transfer_id)
    # NOTE: D counts the request from its pick (its prefill included), so
    # load-aware policies see requests that are still prefilling; _decode
    # and relay_stream take the count over and release it.
    decode.outstanding += 1
    first: FirstTokenWait | None = None
    try:
        if local:
            state.counters.local_decodes += 1
            params = None
        elif prefill is not None and (tokens := _admit_early(state, decode, body, endpoint)):
            params = early_params(transfer_id)
            first = _first_token_wait(state, body, endpoint)
            record.early = _start_early(
                state, prefill, decode, endpoint, body, transfer_id, headers, tokens, first
            )
        else:
            first = _first_token_wait(state, body, endpoint) if prefill is not None else None
            params = await _prefill_or_none(
                state, prefill, decode, endpoint, body, transfer_id, headers, first
            )
        if first is not None:  # NOTE: the proxy tells tokens apart by their ids
            content = dump_json({**decode_body(body, params), "return_token_ids": True})
        else:
            content = decode_content(raw, body, params)
    except BaseException:
        decode.outstanding -= 1
        state.policy.on_finish(prefill, decode, False)
        raise
    tried = [decode]
    while True:
        try:
            timeouts = state.decode_timeouts if record.early is None else state.early_timeouts
            return await _send_decode(
                state, prefill, decode, endpoint, body, content, headers, deadline, timeouts, first
            )
        except ProxyError as exc:
            retry = _other_decoder(state, tried) if exc.retryable else None
            if retry is None:
                raise
            reason = exc.message
        # D got nothing of the request: the KV P pushed there is lost, so
        # another decoder computes the prompt itself (a fallback).
        if prefill is not None and params is not None:
            state.counters.fallbacks += 1
        _cancel_early(record)
        record.early = None
        logger.warning("%s: %s; %s computes the prompt", transfer_id, reason, retry.name)
        prefill, decode, first = None, retry, None
        tried.append(decode)
        decode.outstanding += 1
        record.prefill, record.decode = None, decode.name
        content = decode_content(raw, body, None)


async def _send_decode(
    state: ProxyState,
    prefill: Engine | None,
    decode: Engine,
    endpoint: Endpoint,
    body: dict[str, Any],
    content: bytes,
    headers: dict[str, str],
    deadline: float,
    timeouts: Timeouts,
    first: FirstTokenWait | None = None,
) -> Answer | Relay:
    """D's answer: a stream to relay (see :mod:`fabric.router.relay`) or whole.

    ``timeouts``: an early handoff's D call waits for the prefill too (its
    read bound is ``prefill_timeout_s + decode_timeout_s``). ``first``:
    P's first token goes first (:mod:`fabric.router.first_token`)."""
    url = decode.url + endpoint.path
    if is_stream(body):
        return await relay_stream(
            state, prefill, decode, url, content, headers, deadline, timeouts, first
        )
    return await _decode(state, prefill, decode, url, content, headers, timeouts)


def _candidate_decoders(state: ProxyState) -> list[Engine]:
    decoders = state.pool.candidate_decoders()
    if not decoders:
        raise ProxyError(503, "no decode engine to route to: every one is draining", UNAVAILABLE)
    return decoders


def _other_decoder(state: ProxyState, tried: list[Engine]) -> Engine | None:
    """The least loaded routable decoder not in ``tried``, if any."""
    others = [e for e in state.pool.decoders if e not in tried and e.routable]
    return min(others, key=lambda e: e.outstanding, default=None)


async def _prefix_hints(
    state: ProxyState, body: dict[str, Any], endpoint: Endpoint, engines: list[Engine]
) -> dict[str, int] | None:
    """For cache-aware policies: prompt tokens each engine's store holds."""
    if not state.policy.needs_hints:
        return None
    token_ids = await prompt_token_ids(state, body, endpoint, engines)
    if token_ids is None:
        return None
    hits = await lookup_all(state, engines, token_ids, body_identity(body))
    if any(hit.hit_tokens for hit in hits):
        state.counters.prefix_hits += 1
    return {hit.engine.name: hit.hit_tokens for hit in hits}


def _too_short(state: ProxyState, body: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether the prompt is below ``disaggregate_min_prompt_tokens`` (D computes it)."""
    minimum = state.config.disaggregate_min_prompt_tokens
    return minimum > 0 and estimate_prompt_tokens(body, endpoint) < minimum


def _admit_early(
    state: ProxyState, decode: Engine, body: dict[str, Any], endpoint: Endpoint
) -> int:
    """The prompt's estimated tokens if D takes it at dispatch, else 0
    (sequential flow: ``handoff: sequential``, or D holds ``early_max_tokens``)."""
    if state.config.handoff != "early" or decode.kv_endpoint is None:
        return 0
    if not state.handoff.admits(decode.kv_endpoint):
        state.counters.early_refused += 1
        return 0
    tokens = max(1, estimate_prompt_tokens(body, endpoint))
    limit = state.config.early_max_tokens or (decode.kv_tokens or 0) // 4
    # NOTE: a decoder whose KV size is not known (yet) takes a few at once, not a burst
    unknown = not limit and decode.early_requests >= UNKNOWN_CAPACITY_EARLY
    if unknown or (limit and decode.early_tokens + tokens > limit):
        state.counters.early_refused += 1
        return 0
    return tokens


def _start_early(
    state: ProxyState,
    prefill: Engine,
    decode: Engine,
    endpoint: Endpoint,
    body: dict[str, Any],
    transfer_id: str,
    headers: dict[str, str],
    tokens: int,
    first: FirstTokenWait | None = None,
) -> asyncio.Task[None]:
    """Start the prefill leg of an early handoff (see :mod:`fabric.router.handoff`).

    Its end however it ends (answered, failed, cancelled by the request's end
    or by ``prefill`` being marked down, even before it ran) is told to D and
    releases D's early budget, in the task's done callback. With ``first``,
    P is asked for token ids (and keeps a ``min_tokens`` of at least 1, as
    its one token) and its token is set there (None however else the leg
    ends).
    """
    kv_endpoint = decode.kv_endpoint
    assert kv_endpoint is not None  # _admit_early checked
    content = _prefill_request(body, transfer_id, kv_endpoint, first)
    state.counters.early_handoffs += 1
    decode.early_tokens += tokens
    decode.early_requests += 1
    state.handoff.start(kv_endpoint, transfer_id)
    outcome = {"ok": False, "reason": "the prefill leg failed"}

    async def leg() -> None:
        try:
            params, reason, answer = await _call_prefill(state, prefill, endpoint, content, headers)
        except Exception as exc:  # NOTE: a bug, not an engine failure (those are answers)
            logger.exception("%s: the prefill leg on %s failed", transfer_id, prefill.name)
            outcome["reason"] = f"{type(exc).__name__}: {exc}"
            return
        outcome["ok"], outcome["reason"] = params is not None, reason
        _set_first(first, params, answer)
        if params is None:
            state.counters.fallbacks += 1
            logger.warning(
                "%s: prefill on %s failed (%s); %s recomputes the prompt",
                transfer_id, prefill.name, reason, decode.name,
            )  # fmt: skip

    def ended(task: asyncio.Task[None]) -> None:
        if first is not None and not first.future.done():
            first.future.set_result(None)
        decode.early_tokens -= tokens
        decode.early_requests -= 1
        prefill.legs.discard(task)
        ok = not task.cancelled() and bool(outcome["ok"])
        if task.cancelled():
            outcome["reason"] = (
                f"marked down: {prefill.last_error}"
                if not prefill.healthy
                else "the request ended before its prefill"
            )
        why = "" if ok else f"prefill on {prefill.name}: {outcome['reason']}"
        state.handoff.end(kv_endpoint, transfer_id, ok=ok, reason=why)

    task = asyncio.create_task(leg(), name=f"fabric-prefill-{transfer_id}")
    prefill.legs.add(task)
    task.add_done_callback(ended)
    return task


def _first_token_wait(
    state: ProxyState, body: dict[str, Any], endpoint: Endpoint
) -> FirstTokenWait | None:
    """Where P's first token may go first (:mod:`fabric.router.first_token`), its wait."""
    if state.config.first_token != "prefiller" or not eligible(body, endpoint):
        return None
    future = asyncio.get_running_loop().create_future()
    return FirstTokenWait(future, bool(body.get("return_token_ids")), body)


def _prefill_request(
    body: dict[str, Any], transfer_id: str, kv_endpoint: str, first: FirstTokenWait | None
) -> bytes:
    """P's request; with ``first``, asking for token ids and keeping a
    ``min_tokens`` of at least 1, as its one token."""
    request = prefill_body(body, transfer_id, kv_endpoint)
    if first is not None:
        request["return_token_ids"] = True
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > 0:
            # NOTE: D masks EOS and stop tokens at its first step: so must P, or
            # a sampled (seeded) first token may differ
            request["min_tokens"] = 1
    return dump_json(request)


def _set_first(first: FirstTokenWait | None, params: Any, answer: Any) -> None:
    """P's token for ``first`` from its answer (None: D's goes first)."""
    if first is not None and not first.future.done():
        token = FirstToken.of(answer, asyncio.get_running_loop().time()) if params else None
        first.future.set_result(token)


def _cancel_early(record: InFlight) -> None:
    """Cancel the request's prefill leg if it still runs (P aborts the request)."""
    if record.early is not None and not record.early.done():
        record.early.cancel()


async def _prefill_or_none(
    state: ProxyState,
    prefill: Engine | None,
    decode: Engine,
    endpoint: Endpoint,
    body: dict[str, Any],
    transfer_id: str,
    headers: dict[str, str],
    first: FirstTokenWait | None = None,
) -> dict[str, Any] | None:
    """P's ``kv_transfer_params``, or None (counted as a fallback) when there are none.

    ``first``: P's token is set there (None however else this ends)."""
    if prefill is None:
        state.counters.fallbacks += 1
        logger.debug(
            "%s: no prefiller may serve with %s (down, draining or failed canary); "
            "it computes the prompt",
            transfer_id,
            decode.name,
        )
        return None
    assert decode.kv_endpoint is not None  # EnginePool checks decoders have one
    content = _prefill_request(body, transfer_id, decode.kv_endpoint, first)
    try:
        params, reason, answer = await _call_prefill(state, prefill, endpoint, content, headers)
    except BaseException:
        _set_first(first, None, None)
        raise
    _set_first(first, params, answer)
    if params is None:
        state.counters.fallbacks += 1
        logger.warning(
            "%s: prefill on %s failed (%s); %s computes the prompt",
            transfer_id, prefill.name, reason, decode.name,
        )  # fmt: skip
    return params


async def _call_prefill(
    state: ProxyState, prefill: Engine, endpoint: Endpoint, content: bytes, headers: dict[str, str]
) -> tuple[dict[str, Any] | None, str, Any]:
    """POST the prefill; ``(params, "", P's answer)`` or ``(None, why not, None)``."""
    prefill.outstanding += 1
    try:
        url = prefill.url + endpoint.path
        with prefill.calls.reading():
            response, payload = await state.engines.post_read(
                url, content, headers, state.prefill_timeouts, state.max_answer_bytes
            )
    except httpx.HTTPError as exc:
        state.counters.prefill_errors += 1
        count_transport_error(state, exc)
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            state.connect_failed(prefill, exc)
        return None, describe(exc), None
    finally:
        prefill.outstanding -= 1
    return _prefill_params(state, prefill, response.status, payload)


def _prefill_params(
    state: ProxyState, prefill: Engine, status: int, payload: bytes
) -> tuple[dict[str, Any] | None, str, Any]:
    if not 200 <= status < 300:
        state.counters.prefill_errors += 1
        if is_drain_refusal(status, payload):
            state.counters.drain_refusals += 1
            prefill.saw_draining()
        return None, f"HTTP {status}: {payload[:200].decode(errors='replace')}", None
    try:
        answer = load_json(payload)
        params = answer.get("kv_transfer_params")
    except (ValueError, AttributeError):
        state.counters.prefill_errors += 1
        return None, "answer is not a JSON object", None
    if not isinstance(params, dict) or not params:
        return None, "no kv_transfer_params in the answer (is the fabric connector loaded?)", None
    return params, "", answer


async def _decode(
    state: ProxyState,
    prefill: Engine | None,
    decode: Engine,
    url: str,
    content: bytes,
    headers: dict[str, str],
    timeouts: Timeouts,
) -> Answer:
    """POST to D and return its answer as is (status, body, content type)."""
    ok = False
    try:
        with decode.calls.reading():
            response, payload = await state.engines.post_read(
                url, content, headers, timeouts, state.max_answer_bytes
            )
        ok = response.is_success
    except httpx.HTTPError as exc:
        raise decode_failure(state, decode, exc) from exc
    finally:
        decode.outstanding -= 1
        state.policy.on_finish(prefill, decode, ok)
    if not ok:
        check_drain_refusal(state, decode, response.status, payload)
    content_type = response.content_type
    return Answer(
        response.status, payload, content_type.encode("latin-1") if content_type else JSON
    )


def _forward_headers(head: RequestHead, transfer_id: str) -> dict[str, str]:
    """Headers sent to engines: JSON, the client's credentials, one request id.

    ``accept-encoding: identity``: streams are relayed byte for byte.
    """
    headers = {
        "content-type": "application/json",
        "x-request-id": transfer_id,
        "accept-encoding": "identity",
    }
    if head.authorization is not None:
        headers["authorization"] = head.authorization
    return headers
