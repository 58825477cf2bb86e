"""The PD proxy app: ``create_app(topology) -> FastAPI``.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (the PD flow
of :mod:`fabric.router.pd`), ``GET /v1/models`` (from the first healthy
decoder), ``GET /health`` (readiness: 200 once every engine answers its
``/health`` and every P->D pair passed its canary, else 503 whose
``missing`` says what is not there yet; see :mod:`fabric.router.ready`;
``GET /health?serving=1``: 200 while this proxy can serve requests, see
:func:`can_serve`, for a cluster's readiness probe),
``GET /metrics`` (Prometheus text: counters, readiness, engine state and
load, per-request table sizes) and ``GET /fabric/status`` (the same as
JSON, for ``fabric status``), and ``POST /fabric/lookup|clear|pin`` (the
engines' reuse tiers, see :mod:`fabric.router.controller`; they need the
admin token, see :mod:`fabric.router.admin`).

The app's lifespan opens the clients, runs the early handoffs' word to
the decoders (:mod:`fabric.router.handoff`) and, with ``health_interval_s`` > 0,
the background health loop: every interval it probes every engine
and starts the due canaries (once readiness is watched). The running
proxy's :class:`~fabric.router.state.ProxyState` (``app.state.proxy``)
is the control API for whoever runs the engines (drain, mark down, wait
until ready).

NOTE: per-request overhead is what limits a Python proxy: the two
generation routes are plain ASGI calls that :class:`ProxyApp` dispatches
before FastAPI's machinery (see
:mod:`fabric.router.asgi`); the other routes are plain Starlette routes (no
body models, no dependency injection); there is no middleware, one engine
connection pool is shared, and the server runs without an access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from fabric.config import TopologyConfig
from fabric.errors import FabricError
from fabric.router import controller, pd
from fabric.router.admin import admin_token, authorized
from fabric.router.asgi import error_answer
from fabric.router.engines import Engine, EnginePool, EngineState, describe
from fabric.router.errors import (
    INTERNAL,
    INVALID_REQUEST,
    UNAUTHORIZED,
    UNAVAILABLE,
    ProxyError,
    error_response,
)
from fabric.router.policy import Routing
from fabric.router.prefix import call_store
from fabric.router.requests import CHAT_COMPLETIONS, COMPLETIONS, Endpoint
from fabric.router.state import ProxyState
from fabric.transfer.store_client import resolve_endpoint

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
Generation = Callable[[Scope, Receive, Send], Awaitable[None]]


class ProxyApp(FastAPI):
    """FastAPI, with the generation routes served as plain ASGI calls ahead of it."""

    def __init__(self, state: ProxyState, **options: Any) -> None:
        super().__init__(**options)
        self.state.proxy = state
        self.generation: dict[str, Generation] = {
            endpoint.path: _generation(state, endpoint)
            for endpoint in (COMPLETIONS, CHAT_COMPLETIONS)
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = self.generation.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(topology: TopologyConfig) -> FastAPI:
    """A proxy for ``topology``, whose engines' ports must be known.

    State lives on ``app.state.proxy`` (:class:`ProxyState`); the HTTP client
    is opened and the health loop started by the app's lifespan.
    Raises ``ConfigError`` when an engine has no url/port or a decoder no kv_port,
    or ``connector.secret_env`` names a variable that is not set.
    """
    state = ProxyState(
        topology.proxy,
        EnginePool.from_topology(topology),
        Routing.from_config(topology.proxy),
        store_secret=topology.connector.secret(),
        shared_store=topology.connector.shared_store,
        admin_token=admin_token(topology),
    )
    app = ProxyApp(
        state,
        title="fabric PD proxy",
        lifespan=_lifespan(state),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_route("/v1/models", _guarded(lambda request: _models(state, request)), methods=["GET"])
    app.add_route("/health", _guarded(lambda request: _health(state, request)), methods=["GET"])
    app.add_route("/metrics", _guarded(lambda request: _metrics(state)), methods=["GET"])
    app.add_route("/fabric/status", _guarded(lambda request: _status(state)), methods=["GET"])
    for name, handler in (
        ("lookup", controller.lookup),
        ("clear", controller.clear),
        ("pin", controller.pin),
    ):
        app.add_route(f"/fabric/{name}", _admin(state, handler), methods=["POST"])
    return app


def _lifespan(
    state: ProxyState,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.open_client()
        tasks = [
            asyncio.create_task(state.handoff.run(), name="fabric-proxy-handoff"),
            asyncio.create_task(state.learn_kv_sizes(), name="fabric-proxy-kv-sizes"),
        ]
        if state.config.health_interval_s > 0:
            tasks.append(asyncio.create_task(_health_loop(state), name="fabric-proxy-health"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await state.close_client()

    return lifespan


async def _health_loop(state: ProxyState) -> None:
    """Every ``health_interval_s``: probe every engine, start the due canaries."""
    while True:
        await asyncio.sleep(state.config.health_interval_s)
        try:
            await state.probe_engines()
            state.readiness.tick()
        except Exception:  # NOTE: the loop outlives any one round's failure
            logger.exception("proxy health round failed")


def _generation(state: ProxyState, endpoint: Endpoint) -> Generation:
    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "POST":
            await pd.serve_generation(state, endpoint, scope, receive, send)
            return
        error = ProxyError(405, f"{endpoint.path} accepts POST only", INVALID_REQUEST)
        answer = error_answer(error)
        headers = [(b"content-type", answer.content_type), (b"allow", b"POST")]
        await send({"type": "http.response.start", "status": 405, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})

    return route


def _admin(
    state: ProxyState, handler: Callable[[ProxyState, Request], Awaitable[Response]]
) -> Handler:
    """``handler`` behind the admin token (:mod:`fabric.router.admin`): a
    missing or wrong one is a 401 JSON error, counted, and never reads the body."""

    async def route(request: Request) -> Response:
        if not authorized(request.headers.get("authorization"), state.admin_token):
            state.counters.admin_refused += 1
            client = request.client.host if request.client is not None else "?"
            logger.warning("proxy: refused %s from %s: bad admin token", request.url.path, client)
            answer = error_response(
                401, "admin routes need Authorization: Bearer <admin token>", UNAUTHORIZED
            )
            answer.headers["www-authenticate"] = "Bearer"
            return answer
        return await handler(state, request)

    return _guarded(route)


def _guarded(handler: Handler) -> Handler:
    """Turn every failure into an OpenAI-style JSON error, never a bare 500."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except ProxyError as exc:
            return exc.response()
        except Exception as exc:
            logger.exception("proxy error on %s %s", request.method, request.url.path)
            return error_response(500, f"proxy error: {describe(exc)}", INTERNAL)

    return route


async def _models(state: ProxyState, request: Request) -> Response:
    """``/v1/models`` of the first decoder that answers (healthy ones first),
    with the client's credentials (as a generation request's)."""
    decoders = sorted(state.pool.decoders, key=lambda e: not e.healthy)
    authorization = request.headers.get("authorization")
    headers = {"authorization": authorization} if authorization is not None else None
    reasons = []
    for engine in decoders:
        try:
            response = await state.client.get(
                f"{engine.url}/v1/models", headers=headers, timeout=state.config.health_timeout_s
            )
        except httpx.HTTPError as exc:
            reasons.append(f"{engine.name}: {describe(exc)}")
            continue
        if response.is_success or response.status_code in (401, 403):  # as the engine says
            return Response(response.content, response.status_code, media_type="application/json")
        reasons.append(f"{engine.name}: HTTP {response.status_code}")
    raise ProxyError(
        503, "no decode engine answered /v1/models: " + "; ".join(reasons), UNAVAILABLE
    )


async def _health(state: ProxyState, request: Request) -> Response:
    """Readiness: probe every engine now, start the due canaries (in the
    background), then 200 if nothing is missing, else 503 saying what is.

    With ``?serving=1`` (or ``true``): 200 when :func:`can_serve`, else 503;
    the same body, with ``serving``."""
    await state.probe_engines()
    readiness = state.readiness
    readiness.kick()
    missing = readiness.missing()
    body: dict[str, object] = {
        "status": "unavailable" if missing else "ok",
        "ready": not missing,
        "missing": missing,
        "prefill": {e.name: _engine_health(e) for e in state.pool.prefillers},
        "decode": {e.name: _engine_health(e) for e in state.pool.decoders},
        "pairs": [pair.as_dict() for pair in readiness.pairs],
    }
    if request.query_params.get("serving") not in ("1", "true"):
        return JSONResponse(body, 503 if missing else 200)
    serving = can_serve(state.pool)
    body["status"], body["serving"] = ("ok" if serving else "unavailable"), serving
    return JSONResponse(body, 200 if serving else 503)


def can_serve(pool: EnginePool) -> bool:
    """Whether a request would be served now: some decoder answered its
    latest probe and is not draining. Prefillers do not matter: without one
    (or when every pair with the decoder failed its canary) the decoder
    computes the prompt itself (see :mod:`fabric.router.pd`)."""
    return any(e.routable and e.answered for e in pool.decoders)


def _engine_health(engine: Engine) -> dict[str, object]:
    return {
        "url": engine.url,
        "healthy": engine.healthy,
        "state": engine.state.value,
        "since": engine.since,
        "error": engine.last_error,
    }


async def _metrics(state: ProxyState) -> Response:
    """Prometheus text format: counters, readiness, per-engine state and load, tables."""
    lines = []
    for name, value in state.counter_values().items():
        metric = f"fabric_proxy_{name}_total"
        lines += [f"# TYPE {metric} counter", f"{metric} {value}"]
    lines += [
        "# TYPE fabric_proxy_first_token_lag_seconds summary",
        f"fabric_proxy_first_token_lag_seconds_sum {state.first_token_lag_s}",
        f"fabric_proxy_first_token_lag_seconds_count {state.first_token_lags}",
    ]
    lines += ["# TYPE fabric_proxy_in_flight gauge", f"fabric_proxy_in_flight {state.in_flight}"]
    ready = int(state.readiness.ready)
    lines += ["# TYPE fabric_proxy_ready gauge", f"fabric_proxy_ready {ready}"]
    for gauge in ("healthy", "draining", "outstanding"):
        metric = f"fabric_proxy_engine_{gauge}"
        lines.append(f"# TYPE {metric} gauge")
        for e in state.pool.engines:
            value = int(getattr(e, gauge))
            lines.append(f'{metric}{{engine="{e.name}",role="{e.role}"}} {value}')
    lines.append("# TYPE fabric_proxy_pair_ok gauge")
    for pair in state.readiness.pairs:
        labels = f'prefill="{pair.prefill.name}",decode="{pair.decode.name}"'
        lines.append(f"fabric_proxy_pair_ok{{{labels}}} {int(pair.state.value == 'ok')}")
    lines.append("# TYPE fabric_proxy_table_entries gauge")
    for table, entries in state.tables().items():
        lines.append(f'fabric_proxy_table_entries{{table="{table}"}} {entries}')
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


async def _status(state: ProxyState) -> Response:
    """What the proxy knows (no health probes): engines with their state and
    store occupancy (asked over each kv_port, bounded; None for a down
    engine: no stale numbers), the shared store's, readiness and P->D
    pairs, policies, counters, per-request tables, in-flight."""
    shared = asyncio.ensure_future(_shared_store_status(state))
    stores = await asyncio.gather(*(_store_status(state, e) for e in state.pool.engines))
    readiness = state.readiness
    body = {
        "engines": [
            {
                "name": e.name,
                "role": e.role,
                "url": e.url,
                "healthy": e.healthy,
                "state": e.state.value,
                "since": e.since,
                "outstanding": e.outstanding,
                "error": e.last_error,
                "store": store,
            }
            for e, store in zip(state.pool.engines, stores, strict=True)
        ],
        "shared_store": await shared,
        "ready": readiness.ready,
        "missing": readiness.missing(),
        "pairs": [pair.as_dict() for pair in readiness.pairs],
        "policies": {"prefill": state.policy.prefill.name, "decode": state.policy.decode.name},
        "disaggregate_min_prompt_tokens": state.config.disaggregate_min_prompt_tokens,
        "counters": state.counter_values(),
        "tables": state.tables(),
        "in_flight": state.in_flight,
        "oldest_request_s": state.oldest_request_s(),
    }
    return JSONResponse(body)


STORE_STATUS_KEYS = (
    "num_slots",
    "slot_bytes",
    "free",
    "reserved",
    "filled",
    "pinned",
    "quarantined",
    "holds",
    "disk_files",
    "disk_bytes",
    "disk_budget_bytes",
)


SHARED_STORE_STATUS_KEYS = (
    "service_attaches",
    "service_attach_refused",
    "service_fetches",
    "service_fetched_chunks",
    "service_fetch_failures",
)


async def _shared_store_status(state: ProxyState) -> dict[str, object] | None:
    """The shared store's occupancy and fetch counters, ``{"endpoint", "error"}``
    when it cannot be asked, None when the topology has none."""
    if state.shared_store is None:
        return None
    endpoint = resolve_endpoint(state.shared_store)
    if endpoint is None:
        return {"endpoint": state.shared_store, "error": "endpoint file missing"}
    previous, state.shared_endpoint = state.shared_endpoint, endpoint
    if previous is not None and previous != endpoint:  # restarted on another port
        state.stores.forget(previous)
    try:
        stats = await state.stores.call(endpoint, "stats")
    except (FabricError, OSError) as exc:
        return {"endpoint": endpoint, "error": str(exc)}
    keys = STORE_STATUS_KEYS + SHARED_STORE_STATUS_KEYS
    return {"endpoint": endpoint} | {key: stats[key] for key in keys if key in stats}


async def _store_status(state: ProxyState, engine: Engine) -> dict[str, object] | None:
    """The engine's store occupancy, or ``{"error": ...}``; None without a
    kv_port, and for a down engine (its numbers are unknown, not stale)."""
    if engine.kv_endpoint is None or engine.state is EngineState.DOWN:
        return None
    try:
        stats = await call_store(state, engine, "stats")
    except (FabricError, OSError) as exc:
        return {"error": str(exc)}
    return {key: stats[key] for key in STORE_STATUS_KEYS if key in stats}
