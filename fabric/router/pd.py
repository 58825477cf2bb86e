"""The two-step PD flow of one generation request.

::

    client --body--> proxy
                       | pick (P, D) by policy; transfer_id = uuid4().hex
                       | (CLIENT_ID-xxxxxxxx if the client sent X-Request-Id)
                       |--- body + max_tokens=1, stream=false,
                       |    kv_transfer_params{do_remote_decode, transfer_id,
                       |    decode_kv_endpoint=D} --------------------------> P
                       |<-- {..., kv_transfer_params: {...}} ---------------- P
                       |--- body + P's kv_transfer_params -----------------> D
    client <-----------|<-- JSON or SSE stream, relayed as it comes -------- D

If the prefill fails (unreachable, timeout, non-2xx) or P returns no
``kv_transfer_params``, D gets the body without params and computes the
prompt itself; the fallback is logged and counted. A decoder failure is an
OpenAI-style 502 (unreachable) or 504 (timeout) JSON error; after a stream
has started, an error event ends it.

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
Once a stream is being relayed, Starlette notices the disconnect and the
relay closes D's response (see :mod:`fabric.router.relay`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from uuid import uuid4

import httpx
from starlette.requests import Request
from starlette.responses import Response

from fabric.router.engines import Engine, describe
from fabric.router.errors import ProxyError
from fabric.router.prefix import lookup_all, prompt_token_ids
from fabric.router.relay import deadline_exceeded, decode_failure, relay_stream
from fabric.router.requests import (
    Endpoint,
    decode_body,
    dump_json,
    estimate_prompt_tokens,
    is_stream,
    parse_body,
    prefill_body,
)
from fabric.router.state import ProxyState

logger = logging.getLogger(__name__)

JSON = "application/json"
MAX_CLIENT_ID = 128


async def serve_generation(state: ProxyState, request: Request, endpoint: Endpoint) -> Response:
    """Answer one completion/chat request through a prefiller and a decoder.

    The answer (errors too) carries ``X-Request-Id``: the client's, or the
    transfer id when the client sent none.
    """
    state.counters.requests += 1
    client_id = request.headers.get("x-request-id")
    transfer_id = new_transfer_id(client_id)
    deadline = asyncio.get_running_loop().time() + state.config.request_deadline_s
    try:
        raw = await request.body()
        try:
            async with asyncio.timeout_at(deadline):
                response = await _unless_disconnected(
                    state,
                    request,
                    _serve(state, request, raw, endpoint, transfer_id, deadline),
                    transfer_id,
                )
        except TimeoutError:
            raise deadline_exceeded(state) from None
    except ProxyError as exc:
        exc.request_id = client_id or transfer_id
        raise
    response.headers["x-request-id"] = client_id or transfer_id
    return response


def new_transfer_id(client_id: str | None) -> str:
    """A unique id for P and D (vLLM's request id): the client's id plus a suffix.

    NOTE: clients may reuse ids; P and D need unique ones, hence the suffix.
    """
    if not client_id:
        return uuid4().hex
    return f"{client_id[:MAX_CLIENT_ID]}-{uuid4().hex[:8]}"


async def _unless_disconnected(
    state: ProxyState, request: Request, work: Any, transfer_id: str
) -> Response:
    """Await ``work`` (the flow), cancelled if the client goes away first.

    NOTE: one watcher task per request cancels this task on a disconnect
    (cheaper than running the flow in a task of its own and waiting on both).
    """
    task = asyncio.current_task()
    assert task is not None
    gone = asyncio.Event()
    watch = asyncio.get_running_loop().create_task(_cancel_on_disconnect(request, task, gone))
    response: Response | None = None
    try:
        response = await work
    except asyncio.CancelledError:
        if not gone.is_set():
            raise
    finally:
        watch.cancel()
        if gone.is_set() and task.cancelling():
            task.uncancel()  # our own cancel, not the server's
    if response is not None:
        return response
    state.counters.client_disconnects += 1
    logger.info("%s: the client disconnected; prefill/decode requests dropped", transfer_id)
    # nobody reads this; 499 is the conventional "client closed request"
    return Response(status_code=499)


async def _cancel_on_disconnect(
    request: Request, task: asyncio.Task[Any], gone: asyncio.Event
) -> None:
    """Cancel ``task`` when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()
    task.cancel()


async def _serve(
    state: ProxyState,
    request: Request,
    raw: bytes,
    endpoint: Endpoint,
    transfer_id: str,
    deadline: float,
) -> Response:
    try:
        body = parse_body(raw, endpoint)
    except ProxyError:
        state.counters.client_errors += 1
        raise
    local = _too_short(state, body, endpoint)
    prefillers = [] if local else state.pool.healthy_prefillers()
    decoders = state.pool.candidate_decoders()
    hints = await _prefix_hints(state, body, endpoint, [*prefillers, *decoders])
    prefill, decode = state.policy.pick(prefillers, decoders, body, hints)
    headers = _forward_headers(request, transfer_id)
    # NOTE: D counts the request from its pick (its prefill included), so
    # load-aware policies see requests that are still prefilling; _decode
    # and relay_stream take the count over and release it.
    decode.outstanding += 1
    try:
        if local:
            state.counters.local_decodes += 1
            params = None
        else:
            params = await _prefill_or_none(
                state, prefill, decode, endpoint, body, transfer_id, headers
            )
        content = dump_json(decode_body(body, params))
    except BaseException:
        decode.outstanding -= 1
        state.policy.on_finish(prefill, decode, False)
        raise
    try:
        return await _send_decode(
            state, prefill, decode, endpoint, body, content, headers, deadline
        )
    except ProxyError as exc:
        retry = _other_decoder(state, decode) if exc.retryable else None
        if retry is None:
            raise
    # D was unreachable before anything reached it: the KV P pushed there is
    # lost, so another decoder computes the prompt itself (a fallback).
    state.counters.fallbacks += 1
    logger.warning(
        "%s: decoder %s is unreachable; %s computes the prompt",
        transfer_id, decode.name, retry.name,
    )  # fmt: skip
    retry.outstanding += 1
    content = dump_json(decode_body(body, None))
    return await _send_decode(state, None, retry, endpoint, body, content, headers, deadline)


async def _send_decode(
    state: ProxyState,
    prefill: Engine | None,
    decode: Engine,
    endpoint: Endpoint,
    body: dict[str, Any],
    content: bytes,
    headers: dict[str, str],
    deadline: float,
) -> Response:
    """D's answer: relayed as a stream (see :mod:`fabric.router.relay`) or whole."""
    if is_stream(body):
        request = state.engine_request(decode, endpoint.path, content, headers)
        return await relay_stream(state, prefill, decode, request, deadline)
    return await _decode(state, prefill, decode, endpoint, content, headers)


def _other_decoder(state: ProxyState, failed: Engine) -> Engine | None:
    """The least loaded healthy decoder other than ``failed``, if any."""
    others = [e for e in state.pool.decoders if e is not failed and e.healthy]
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
    hits = await lookup_all(state, engines, token_ids)
    if any(hit.hit_tokens for hit in hits):
        state.counters.prefix_hits += 1
    return {hit.engine.name: hit.hit_tokens for hit in hits}


def _too_short(state: ProxyState, body: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether the prompt is below ``disaggregate_min_prompt_tokens`` (D computes it)."""
    minimum = state.config.disaggregate_min_prompt_tokens
    return minimum > 0 and estimate_prompt_tokens(body, endpoint) < minimum


async def _prefill_or_none(
    state: ProxyState,
    prefill: Engine | None,
    decode: Engine,
    endpoint: Endpoint,
    body: dict[str, Any],
    transfer_id: str,
    headers: dict[str, str],
) -> dict[str, Any] | None:
    """P's ``kv_transfer_params``, or None (counted as a fallback) when there are none."""
    if prefill is None:
        state.counters.fallbacks += 1
        logger.debug("%s: no healthy prefiller; %s computes the prompt", transfer_id, decode.name)
        return None
    assert decode.kv_endpoint is not None  # EnginePool checks decoders have one
    content = dump_json(prefill_body(body, transfer_id, decode.kv_endpoint))
    params, reason = await _call_prefill(state, prefill, endpoint, content, headers)
    if params is None:
        state.counters.fallbacks += 1
        logger.warning(
            "%s: prefill on %s failed (%s); %s computes the prompt",
            transfer_id, prefill.name, reason, decode.name,
        )  # fmt: skip
    return params


async def _call_prefill(
    state: ProxyState, prefill: Engine, endpoint: Endpoint, content: bytes, headers: dict[str, str]
) -> tuple[dict[str, Any] | None, str]:
    """POST the prefill; ``(params, "")`` or ``(None, why not)``."""
    prefill.outstanding += 1
    try:
        request = state.engine_request(prefill, endpoint.path, content, headers, prefill=True)
        response = await state.send(request)
    except httpx.HTTPError as exc:
        state.counters.prefill_errors += 1
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            prefill.mark_down(describe(exc))
        return None, describe(exc)
    finally:
        prefill.outstanding -= 1
    return _prefill_params(state, response)


def _prefill_params(
    state: ProxyState, response: httpx.Response
) -> tuple[dict[str, Any] | None, str]:
    if not response.is_success:
        state.counters.prefill_errors += 1
        return None, f"HTTP {response.status_code}: {response.text[:200]}"
    try:
        params = response.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        state.counters.prefill_errors += 1
        return None, "answer is not a JSON object"
    if not isinstance(params, dict) or not params:
        return None, "no kv_transfer_params in the answer (is the fabric connector loaded?)"
    return params, ""


async def _decode(
    state: ProxyState,
    prefill: Engine | None,
    decode: Engine,
    endpoint: Endpoint,
    content: bytes,
    headers: dict[str, str],
) -> Response:
    """POST to D and return its answer as is (status, body, content type)."""
    ok = False
    try:
        request = state.engine_request(decode, endpoint.path, content, headers)
        response = await state.send(request)
        ok = response.is_success
    except httpx.HTTPError as exc:
        raise decode_failure(state, decode, exc) from exc
    finally:
        decode.outstanding -= 1
        state.policy.on_finish(prefill, decode, ok)
    media_type = response.headers.get("content-type", JSON)
    return Response(response.content, response.status_code, media_type=media_type)


def _forward_headers(request: Request, transfer_id: str) -> dict[str, str]:
    """Headers sent to engines: JSON, the client's credentials, one request id.

    ``accept-encoding: identity``: streams are relayed byte for byte.
    """
    headers = {"content-type": JSON, "x-request-id": transfer_id, "accept-encoding": "identity"}
    authorization = request.headers.get("authorization")
    if authorization is not None:
        headers["authorization"] = authorization
    return headers
