"""Admin routes over the engines' reuse tiers.

``POST /fabric/lookup``  ``{"prompt": str | [ids]} | {"messages": [...]}``
    how many leading tokens of the prompt each engine's store holds (in
    memory or on disk); ``{"prompt_tokens", "engines": [{name, role,
    hit_tokens, disk_tokens, chunk_tokens, error}]}``.
``POST /fabric/clear``   ``{"tier": "memory" | "disk" | "all", "engine"?: name}``
    empty a tier of every engine's store (or of one engine's);
    ``{"engines": {name: {"cleared": n} | {"error": ...}}}``.
``POST /fabric/pin``     ``{"prompt" | "messages", "engine"?: name, "pin"?: bool}``
    pin (default) or unpin the prompt's chunks so they are never evicted;
    ``{"engines": {name: {"chunks": n} | {"error": ...}}}``.

Every engine is asked at once, each bounded by ``proxy.lookup_timeout_ms``;
an engine that does not answer is reported with its error, never waited on.
Bad input (unknown fields too: a typo must not widen a clear to every
engine) gets a 400 JSON error naming the field; an unknown engine a 404.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fabric.errors import FabricError
from fabric.router.asgi import RequestHead, read_body
from fabric.router.engines import Engine
from fabric.router.errors import INVALID_REQUEST, UNAVAILABLE, ProxyError, bad_request
from fabric.router.prefix import body_identity, call_store, lookup_all, prompt_token_ids
from fabric.router.requests import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Endpoint,
    check_known_fields,
    check_messages,
    check_prompt,
    load_json_object,
)
from fabric.router.state import ProxyState

TIERS = ("memory", "disk", "all")


async def lookup(state: ProxyState, request: Request) -> Response:
    body = await _json(state, request, ("prompt", "messages", "model", "engine", "cache_salt"))
    engines = _engines(state, body)
    token_ids = await _token_ids(state, body, engines)
    hits = await lookup_all(state, engines, token_ids, body_identity(body))
    return JSONResponse(
        {"prompt_tokens": len(token_ids), "engines": [hit.as_dict() for hit in hits]}
    )


async def clear(state: ProxyState, request: Request) -> Response:
    body = await _json(state, request, ("tier", "engine"))
    tier = body.get("tier", "all")
    if tier not in TIERS:
        raise bad_request(f"tier must be one of {list(TIERS)}, not {tier!r}", "tier")
    engines = _engines(state, body)
    results = await _each(state, engines, "clear", "cleared", tier)
    return JSONResponse({"engines": results})


async def pin(state: ProxyState, request: Request) -> Response:
    body = await _json(state, request, ("prompt", "messages", "model", "engine", "pin"))
    do_pin = body.get("pin", True)
    if not isinstance(do_pin, bool):
        raise bad_request("pin must be a boolean", "pin")
    engines = _engines(state, body)
    token_ids = await _token_ids(state, body, engines)
    results = await _each(state, engines, "pin", "chunks", token_ids, pin=do_pin)
    return JSONResponse({"prompt_tokens": len(token_ids), "engines": results})


async def _each(
    state: ProxyState, engines: list[Engine], method: str, field: str, *args: Any, **kw: Any
) -> dict[str, dict[str, Any]]:
    async def one(engine: Engine) -> dict[str, Any]:
        try:
            return {field: await call_store(state, engine, method, *args, **kw)}
        except (FabricError, OSError) as exc:
            return {"error": str(exc)}

    answers = await asyncio.gather(*(one(e) for e in engines))
    return {e.name: answer for e, answer in zip(engines, answers, strict=True)}


async def _json(state: ProxyState, request: Request, known: tuple[str, ...]) -> dict[str, Any]:
    head = RequestHead.from_scope(request.scope)
    raw = await read_body(request.receive, head, state.config.max_body_bytes)
    body = load_json_object(raw or b"{}")
    check_known_fields(body, known)
    return body


def _engines(state: ProxyState, body: dict[str, Any]) -> list[Engine]:
    name = body.get("engine")
    if name is None:
        return state.pool.engines
    if not isinstance(name, str):
        raise bad_request("engine must be an engine name", "engine")
    for engine in state.pool.engines:
        if engine.name == name:
            return [engine]
    known = [e.name for e in state.pool.engines]
    raise ProxyError(404, f"no engine named {name!r}; engines: {known}", INVALID_REQUEST, "engine")


async def _token_ids(state: ProxyState, body: dict[str, Any], engines: list[Engine]) -> list[int]:
    endpoint: Endpoint
    if "messages" in body:
        check_messages(body["messages"])
        endpoint = CHAT_COMPLETIONS
    elif body.get("prompt"):
        check_prompt(body["prompt"])
        if isinstance(body["prompt"], list) and not isinstance(body["prompt"][0], int):
            raise bad_request("give one prompt: text or a list of token ids", "prompt")
        endpoint = COMPLETIONS
    else:
        raise bad_request("give a prompt (text or token ids) or messages", "prompt")
    candidates = [*engines, *(e for e in state.pool.engines if e not in engines)]
    token_ids = await prompt_token_ids(state, body, endpoint, candidates, tries=len(candidates))
    if token_ids is None:
        raise ProxyError(
            503,
            "could not tokenize the prompt: no engine answered /tokenize "
            "(or prompt is a list that is not token ids)",
            UNAVAILABLE,
        )
    return token_ids
