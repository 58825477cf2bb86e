"""What each engine's store holds of a prompt, as the proxy sees it.

Used by the cache-aware policy and the ``/fabric/lookup|pin`` admin routes:

1. the prompt's token ids: given as ids, or from one engine's ``/tokenize``
   (vLLM's endpoint: the same tokenizer and chat template the engine
   applies to the request), asked in turn among the routable ones (not
   draining, not down), bounded by ``proxy.lookup_timeout_ms``; a failure,
   a timeout or an answer that is not token ids is a miss, not retried on
   another engine;
2. one ``Lookup`` per engine over its fabric control channel, all at once,
   each bounded by ``proxy.lookup_timeout_ms`` in all, never on the event
   loop and never queued behind another request's lookup; a store that
   keeps not answering is skipped for a while (see
   :mod:`fabric.router.stores`).

Nothing here is required to serve a request: a prompt that cannot be
tokenized or an engine that does not answer counts as no hit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from fabric.errors import FabricError
from fabric.kv.identity import BASE, KeyIdentity
from fabric.router.engines import Engine, describe

if TYPE_CHECKING:
    from fabric.router.requests import Endpoint
    from fabric.router.state import ProxyState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineHit:
    """One engine's answer: leading prompt tokens its store holds."""

    engine: Engine
    hit_tokens: int = 0
    disk_tokens: int = 0
    chunk_tokens: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.engine.name,
            "role": self.engine.role,
            "hit_tokens": self.hit_tokens,
            "disk_tokens": self.disk_tokens,
            "chunk_tokens": self.chunk_tokens,
            "error": self.error,
        }


async def prompt_token_ids(
    state: ProxyState,
    body: dict[str, Any],
    endpoint: Endpoint,
    engines: Sequence[Engine],
    *,
    tries: int = 1,
) -> list[int] | None:
    """The token ids of the request's (single) prompt, or None.

    Asks ``/tokenize`` of at most ``tries`` of the routable ``engines`` in
    turn, each call bounded by ``proxy.lookup_timeout_ms``: a request waits
    at most that long for its hints' tokens (the admin routes, given an
    engine, ask it first and more of them).
    """
    prompt: Any = body.get("prompt")
    if endpoint.input_field == "prompt" and _is_ids(prompt):
        return list(prompt)
    if endpoint.input_field == "prompt" and isinstance(prompt, str):
        payload: dict[str, Any] = {"prompt": prompt}
    elif endpoint.input_field == "messages" and isinstance(body.get("messages"), list):
        payload = {"messages": body["messages"], "add_generation_prompt": True}
    else:
        return None  # batches of prompts: no single prefix
    if "model" in body:
        payload["model"] = body["model"]
    for engine in _tokenizers(state, engines, tries):
        tokens = await _tokenize(state, engine, payload)
        if tokens is not None:
            return tokens
    return None


def _tokenizers(state: ProxyState, engines: Sequence[Engine], tries: int) -> list[Engine]:
    """Up to ``tries`` routable engines, the first one taken in turn across calls."""
    routable = [e for e in engines if e.routable]
    if not routable:
        return []
    if tries == 1:
        state.tokenize_turn += 1
        return [routable[state.tokenize_turn % len(routable)]]
    return routable[:tries]


async def _tokenize(state: ProxyState, engine: Engine, payload: dict[str, Any]) -> list[int] | None:
    """``engine``'s ``/tokenize`` of ``payload`` within the lookup bound; None on any failure."""
    bound_s = state.config.lookup_timeout_ms / 1000
    try:
        async with asyncio.timeout(bound_s):
            response = await state.client.post(
                f"{engine.url}/tokenize", json=payload, timeout=bound_s
            )
    except (httpx.HTTPError, TimeoutError) as exc:
        logger.debug("tokenize on %s failed: %s", engine.name, describe(exc))
        return None
    if response.status_code != 200:
        logger.debug("tokenize on %s answered %s", engine.name, response.status_code)
        return None
    try:
        tokens = response.json().get("tokens")
    except (ValueError, AttributeError):
        tokens = None
    if not _is_ids(tokens):
        logger.debug("tokenize on %s: the answer holds no token ids", engine.name)
        return None
    return list(tokens)


def body_identity(body: dict[str, Any]) -> KeyIdentity:
    """The key identity the proxy can tell from a request body: its
    ``cache_salt``. NOTE: an adapter's identity includes a digest of its
    files, which only the engine knows; the proxy asks with the base
    identity, so a LoRA request's hint counts base-model chunks. Hints only
    steer routing: the engine keys every lookup it acts on itself."""
    salt = body.get("cache_salt")
    return KeyIdentity(cache_salt=salt) if isinstance(salt, str) and salt else BASE


async def lookup_all(
    state: ProxyState,
    engines: Sequence[Engine],
    token_ids: list[int],
    identity: KeyIdentity = BASE,
) -> list[EngineHit]:
    """Ask every engine with a control endpoint how much of ``token_ids`` it holds."""
    lookups = (lookup_one(state, e, token_ids, identity) for e in engines)
    return list(await asyncio.gather(*lookups))


async def lookup_one(
    state: ProxyState, engine: Engine, token_ids: list[int], identity: KeyIdentity = BASE
) -> EngineHit:
    if engine.kv_endpoint is None:
        return EngineHit(engine, error="no kv_port: its store cannot be asked")
    try:
        result = await state.stores.call(engine.kv_endpoint, "lookup", token_ids, identity=identity)
    except (FabricError, OSError) as exc:
        return EngineHit(engine, error=str(exc))
    tokens = result.chunk_tokens
    return EngineHit(engine, result.hit_chunks * tokens, result.disk_chunks * tokens, tokens)


async def fabric_threads_down(state: ProxyState, engine: Engine) -> str | None:
    """Why ``engine``'s fabric side cannot serve KV (a thread of its connector
    is down), or None; an engine without a control endpoint, or one that does
    not answer within the lookup bound, is judged by ``/health`` alone."""
    if engine.kv_endpoint is None:
        return None
    try:
        stats = await state.stores.call(engine.kv_endpoint, "stats")
    except (FabricError, OSError):
        return None
    down = stats.get("threads_down", 0)
    return f"{down} fabric connector thread(s) down: it cannot load KV" if down else None


async def call_store(state: ProxyState, engine: Engine, method: str, *args: Any, **kw: Any) -> Any:
    """``StoreClient.<method>`` on ``engine``'s store, bounded (admin routes, status)."""
    if engine.kv_endpoint is None:
        raise FabricError(f"{engine.name} has no kv_port: its store cannot be reached")
    return await state.stores.call(engine.kv_endpoint, method, *args, **kw)


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
