"""A minimal PD proxy for vLLM's own NixlConnector: the peer fabric is measured against.

It follows the flow vLLM documents for disaggregated serving with the
NixlConnector (one prefiller, one decoder, no policy, no fallback)::

    client --body--> proxy
                       |--- body + max_tokens=1, stream=false,
                       |    kv_transfer_params{do_remote_decode: true,
                       |    do_remote_prefill: false, remote_*: null} --------> P
                       |<-- {..., kv_transfer_params: {do_remote_prefill: true,
                       |    remote_engine_id, remote_block_ids, remote_host,
                       |    remote_port, remote_request_id, ...}} ------------ P
                       |--- body + P's kv_transfer_params -------------------> D
    client <-----------|<-- JSON or SSE stream, relayed as it comes ---------- D

D then pulls P's blocks with NIXL READ. Both engines get the same
``X-Request-Id``. A failed prefill is a 502 (the comparison wants to see
failures, not hide them behind a local recompute).

Run it: ``python -m fabric.bench.nixl_proxy --port N --prefill URL --decode URL``.
The body rewriting (:func:`prefill_body`, :func:`decode_body`) is also used
by ``benchmarks/pd_vs_nixl.py`` when it makes the two calls itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fabric.router.errors import INVALID_REQUEST, UPSTREAM_ERROR, error_response
from fabric.router.requests import one_token_body

# NOTE: a prefill must not stream (vLLM refuses stream_options without stream)
# and must stop after one token.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What P gets: one token, no stream, and the NixlConnector's "remote decode" params."""
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return one_token_body(body, params)


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """What D gets: the client's body with the params P returned."""
    return {**body, "kv_transfer_params": kv_transfer_params}


@dataclass(frozen=True)
class NixlProxyConfig:
    """Where P and D answer, and the bound on each engine call."""

    prefill_url: str
    decode_url: str
    timeout_s: float = 1800.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("prefill_url", "decode_url"):
            if not getattr(self, name).startswith(("http://", "https://")):
                raise ValueError(f"{name}: {getattr(self, name)!r} is not an http(s) URL")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")


class _PrefillFailed(Exception):
    pass


def create_app(
    config: NixlProxyConfig, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """The proxy app; one shared HTTP client lives on ``app.state.client`` while it runs.

    ``transport`` replaces the network (tests).
    """
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            timeout=timeout, limits=limits, transport=transport, trust_env=False
        ) as client:
            app.state.client = client
            yield

    app = FastAPI(
        title="NixlConnector PD proxy",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    for path in GENERATION_PATHS:
        app.add_route(path, _generation(app, config, path), methods=["POST"])
    app.add_route("/health", _health(app, config), methods=["GET"])
    return app


def _generation(app: FastAPI, config: NixlProxyConfig, path: str) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", INVALID_REQUEST)
        client: httpx.AsyncClient = app.state.client
        headers = {"x-request-id": request.headers.get("x-request-id") or uuid4().hex}
        try:
            params = await _prefill(client, config.prefill_url + path, body, headers)
        except _PrefillFailed as exc:
            return error_response(502, f"prefill failed: {exc}", UPSTREAM_ERROR)
        return await _decode(client, config.decode_url + path, decode_body(body, params), headers)

    return route


async def _prefill(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    try:
        response = await client.post(url, json=prefill_body(body), headers=headers)
    except httpx.HTTPError as exc:
        raise _PrefillFailed(f"{type(exc).__name__}: {exc}") from exc
    if not response.is_success:
        raise _PrefillFailed(f"HTTP {response.status_code}: {response.text[:300]}")
    try:
        params = response.json().get("kv_transfer_params")
    except (ValueError, AttributeError) as exc:
        raise _PrefillFailed("P's answer is not a JSON object") from exc
    if not isinstance(params, dict) or not params:
        raise _PrefillFailed("no kv_transfer_params in P's answer (is NixlConnector loaded?)")
    return params


async def _decode(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Response:
    """D's answer, relayed chunk by chunk when streamed, else whole."""
    request = client.build_request("POST", url, json=body, headers=headers)
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        return error_response(502, f"decode failed: {type(exc).__name__}: {exc}", UPSTREAM_ERROR)
    media_type = response.headers.get("content-type", "application/json")
    if not body.get("stream") or not response.is_success:
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        return Response(content, response.status_code, media_type=media_type)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    return StreamingResponse(relay(), response.status_code, media_type=media_type)


def _health(app: FastAPI, config: NixlProxyConfig) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        client: httpx.AsyncClient = app.state.client
        status: dict[str, int | str] = {}
        for role, url in (("prefill", config.prefill_url), ("decode", config.decode_url)):
            try:
                status[role] = (await client.get(url + "/health", timeout=5.0)).status_code
            except httpx.HTTPError as exc:
                status[role] = f"{type(exc).__name__}: {exc}"
        ok = all(code == 200 for code in status.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", **status}, 200 if ok else 503)

    return route


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the proxy until interrupted."""
    import uvicorn

    p = argparse.ArgumentParser(
        prog="python -m fabric.bench.nixl_proxy", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="URL of the NixlConnector prefiller")
    p.add_argument("--decode", required=True, help="URL of the NixlConnector decoder")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="bound on each engine call")
    ns = p.parse_args(argv)
    config = NixlProxyConfig(ns.prefill.rstrip("/"), ns.decode.rstrip("/"), ns.timeout_s)
    app = create_app(config)
    uvicorn.run(app, host=ns.host, port=ns.port, access_log=False, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
