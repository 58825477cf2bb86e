"""The two-step PD flow of one generation request.

::

    client --body--> proxy
                       | pick (P, D) by policy; transfer_id = uuid4().hex
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
"""

from __future__ import annotations

import logging
from typing import Any
from uuid import uuid4

import httpx
from starlette.requests import Request
from starlette.responses import Response

from fabric.router.engines import Engine, describe
from fabric.router.errors import ProxyError
from fabric.router.relay import decode_failure, relay_stream
from fabric.router.requests import (
    Endpoint,
    decode_body,
    dump_json,
    is_stream,
    parse_body,
    prefill_body,
)
from fabric.router.state import ProxyState

logger = logging.getLogger(__name__)

JSON = "application/json"


async def serve_generation(state: ProxyState, request: Request, endpoint: Endpoint) -> Response:
    """Answer one completion/chat request through a prefiller and a decoder."""
    state.counters.requests += 1
    try:
        body = parse_body(await request.body(), endpoint)
    except ProxyError:
        state.counters.client_errors += 1
        raise
    prefill, decode = state.policy.pick(
        state.pool.healthy_prefillers(), state.pool.candidate_decoders(), body
    )
    transfer_id = uuid4().hex
    headers = _forward_headers(request, transfer_id)
    params = await _prefill_or_none(state, prefill, decode, endpoint, body, transfer_id, headers)
    content = dump_json(decode_body(body, params))
    if is_stream(body):
        return await _stream_decode(state, prefill, decode, endpoint, content, headers)
    return await _decode(state, prefill, decode, endpoint, content, headers)


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
        response = await state.client.send(request)
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
    decode.outstanding += 1
    ok = False
    try:
        request = state.engine_request(decode, endpoint.path, content, headers)
        response = await state.client.send(request)
        ok = response.is_success
    except httpx.HTTPError as exc:
        raise decode_failure(state, decode, exc) from exc
    finally:
        decode.outstanding -= 1
        state.policy.on_finish(prefill, decode, ok)
    media_type = response.headers.get("content-type", JSON)
    return Response(response.content, response.status_code, media_type=media_type)


async def _stream_decode(
    state: ProxyState,
    prefill: Engine | None,
    decode: Engine,
    endpoint: Endpoint,
    content: bytes,
    headers: dict[str, str],
) -> Response:
    """Relay D's stream (see :mod:`fabric.router.relay`)."""
    request = state.engine_request(decode, endpoint.path, content, headers)
    return await relay_stream(state, prefill, decode, request)


def _forward_headers(request: Request, transfer_id: str) -> dict[str, str]:
    """Headers sent to engines: JSON, the client's credentials, one request id.

    ``accept-encoding: identity``: streams are relayed byte for byte.
    """
    headers = {"content-type": JSON, "x-request-id": transfer_id, "accept-encoding": "identity"}
    authorization = request.headers.get("authorization")
    if authorization is not None:
        headers["authorization"] = authorization
    return headers
