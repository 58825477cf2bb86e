"""A minimal PD proxy for vLLM's own NIXL connectors: the peers fabric is measured against.

One prefiller, one decoder, no policy, no fallback; two modes, one per
connector of vLLM's ``nixl`` package.

``--mode pull`` (``NixlConnector`` = ``NixlPullConnector``) follows the flow
vLLM documents for disaggregated serving: P first, then D with what P
returned; D pulls P's blocks with NIXL READ::

    client --body--> proxy
                       |--- body + max_tokens=1, stream=false,
                       |    kv_transfer_params{do_remote_decode: true,
                       |    do_remote_prefill: false, remote_*: null} --------> P
                       |<-- {..., kv_transfer_params: {do_remote_prefill: true,
                       |    remote_engine_id, remote_block_ids, remote_host,
                       |    remote_port, remote_request_id, ...}} ------------ P
                       |--- body + P's kv_transfer_params -------------------> D
    client <-----------|<-- JSON or SSE stream, relayed as it comes ---------- D

``--mode push`` (``NixlPushConnector``) sends both legs at once, as vLLM's
push scheduler (``nixl/push_scheduler.py``) expects: D allocates the
prompt's blocks at once and registers them with P over NIXL (a PUSH_REG
notification to P's agent, found through P's side channel); P, when its
prefill finishes, matches the registration by base request id (the
request id without vLLM's random ``-<8 hex>`` suffix, so both legs carry
the same ``X-Request-Id``) and NIXL WRITEs its blocks into D's::

    client --body--> proxy
                       |--- body + max_tokens=1, stream=false,
                       |    kv_transfer_params{do_remote_decode: true, ...} --> P
                       |--- body + kv_transfer_params{do_remote_prefill: true,
                       |    do_remote_decode: false, remote_engine_id,
                       |    remote_host, remote_port (P's side channel),
                       |    tp_size, remote_request_id} -----------------------> D
                       |<-- P's answer: only says whether the prefill failed --- P
    client <-----------|<-- D's answer, relayed once P answered --------------- D

P's coordinates come from its configuration: ``engine_id`` set explicitly
in P's ``kv_transfer_config``, its side channel from P's
``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``VLLM_NIXL_SIDE_CHANNEL_PORT``.
``remote_request_id`` is the ``X-Request-Id`` (vLLM requires the key; P's
own request id is not known before P answers, and it only names the
request in D's lease heartbeats, which P ignores for an id it does not
hold). D's first token cannot come before P's prefill finished, so holding
D's answer until P's arrives costs nothing; it lets a failed P leg still be
answered as an error.

In both modes a failed prefill (an error, no answer, or an answer without
``kv_transfer_params``: no connector on P) is a 502 (the comparison wants
to see failures, not hide them behind a local recompute); in push mode D's
leg is then closed (vLLM aborts it). A D leg that fails before P answered
is answered at once and P's leg is cancelled.

Run it: ``python -m benchmarks.nixl_proxy --port N --prefill URL --decode URL
[--mode push --prefill-engine-id ID --prefill-side-channel HOST:PORT]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
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
MODES = ("pull", "push")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What P gets (both modes): one token, no stream, and the "remote decode" params."""
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
    """What D gets in pull mode: the client's body with the params P returned."""
    return {**body, "kv_transfer_params": kv_transfer_params}


@dataclass(frozen=True)
class NixlPeer:
    """Where a push decoder finds its prefiller: P's engine id and NIXL side channel."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.engine_id or not self.host:
            raise ValueError("a NIXL peer needs an engine id and a host")
        if not 0 < self.port < 65536 or self.tp_size < 1:
            raise ValueError(f"bad NIXL peer port {self.port} or tp_size {self.tp_size}")


def push_decode_params(prefill: NixlPeer, request_id: str) -> dict[str, Any]:
    """D's ``kv_transfer_params`` in push mode: receive P's blocks by NIXL WRITE."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.host,
        "remote_port": prefill.port,
        "tp_size": prefill.tp_size,
        "remote_request_id": request_id,
    }


def push_decode_body(body: dict[str, Any], prefill: NixlPeer, request_id: str) -> dict[str, Any]:
    """What D gets in push mode, sent with P's leg."""
    return {**body, "kv_transfer_params": push_decode_params(prefill, request_id)}


@dataclass(frozen=True)
class NixlProxyConfig:
    """Where P and D answer, the mode, P's NIXL coordinates (push), the bound on each call."""

    prefill_url: str
    decode_url: str
    timeout_s: float = 1800.0
    connect_timeout_s: float = 5.0
    mode: Literal["pull", "push"] = "pull"
    prefill_nixl: NixlPeer | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_url", "decode_url"):
            if not getattr(self, name).startswith(("http://", "https://")):
                raise ValueError(f"{name}: {getattr(self, name)!r} is not an http(s) URL")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.mode not in MODES:
            raise ValueError(f"mode: {self.mode!r} is not one of {MODES}")
        if self.mode == "push" and self.prefill_nixl is None:
            raise ValueError("push mode needs the prefiller's engine id and side channel")


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
        title=f"NIXL {config.mode} PD proxy",
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
        request_id = request.headers.get("x-request-id") or uuid4().hex
        headers = {"x-request-id": request_id}
        if config.mode == "push":
            assert config.prefill_nixl is not None  # NixlProxyConfig checked
            d_body = push_decode_body(body, config.prefill_nixl, request_id)
            return await _push(client, config, path, body, d_body, headers)
        try:
            params = await _prefill(client, config.prefill_url + path, body, headers)
        except _PrefillFailed as exc:
            return error_response(502, f"prefill failed: {exc}", UPSTREAM_ERROR)
        d_body = decode_body(body, params)
        try:
            response = await _send_decode(client, config.decode_url + path, d_body, headers)
        except httpx.HTTPError as exc:
            return _decode_failed(exc)
        return await _relay(response, bool(body.get("stream")))

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
        raise _PrefillFailed("no kv_transfer_params in P's answer (is a NIXL connector loaded?)")
    return params


async def _send_decode(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> httpx.Response:
    """D's answer, its body not read yet (the caller relays or closes it)."""
    request = client.build_request("POST", url, json=body, headers=headers)
    return await client.send(request, stream=True)


def _decode_failed(exc: BaseException) -> Response:
    return error_response(502, f"decode failed: {type(exc).__name__}: {exc}", UPSTREAM_ERROR)


async def _push(
    client: httpx.AsyncClient,
    config: NixlProxyConfig,
    path: str,
    body: dict[str, Any],
    d_body: dict[str, Any],
    headers: dict[str, str],
) -> Response:
    """Both legs at once; D's answer once P answered (see the module docstring)."""
    prefill = asyncio.ensure_future(_prefill(client, config.prefill_url + path, body, headers))
    decode = asyncio.ensure_future(_send_decode(client, config.decode_url + path, d_body, headers))
    try:
        await asyncio.wait([prefill, decode], return_when=asyncio.FIRST_COMPLETED)
        if decode.done() and (decode.exception() is not None or not decode.result().is_success):
            await _discard(prefill)
            exc = decode.exception()
            if exc is not None:
                return _decode_failed(exc)
            return await _relay(decode.result(), False)  # D's error answer, whole
        try:
            await prefill
        except _PrefillFailed as failed:
            await _discard(decode)
            return error_response(502, f"prefill failed: {failed}", UPSTREAM_ERROR)
        try:
            response = await decode
        except httpx.HTTPError as exc:
            return _decode_failed(exc)
        return await _relay(response, bool(body.get("stream")))
    except BaseException:
        await _discard(prefill, decode)  # NOTE: cancelled (the client left) or a bug
        raise


async def _discard(*legs: asyncio.Future[Any]) -> None:
    """Cancel the legs still running; close an answer nobody will read (vLLM aborts it)."""
    for leg in legs:
        leg.cancel()
    await asyncio.gather(*legs, return_exceptions=True)
    for leg in legs:
        if leg.done() and not leg.cancelled() and leg.exception() is None:
            result = leg.result()
            if isinstance(result, httpx.Response):
                await result.aclose()


async def _relay(response: httpx.Response, stream: bool) -> Response:
    """D's answer, relayed chunk by chunk when streamed, else whole."""
    media_type = response.headers.get("content-type", "application/json")
    if not stream or not response.is_success:
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        return Response(content, response.status_code, media_type=media_type)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    return StreamingResponse(chunks(), response.status_code, media_type=media_type)


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


def parse_args(argv: Sequence[str] | None = None) -> tuple[NixlProxyConfig, str, int]:
    """The proxy's config, host and port from the command line."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.nixl_proxy", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="URL of the prefiller")
    p.add_argument("--decode", required=True, help="URL of the decoder")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="bound on each engine call")
    p.add_argument(
        "--mode", choices=MODES, default="pull", help="NixlConnector or NixlPushConnector"
    )
    p.add_argument("--prefill-engine-id", help="push: P's engine_id (its kv_transfer_config)")
    p.add_argument(
        "--prefill-side-channel", metavar="HOST:PORT", help="push: P's NIXL side channel"
    )
    p.add_argument("--prefill-tp-size", type=int, default=1, help="push: P's tensor parallelism")
    ns = p.parse_args(argv)
    peer = None
    if ns.mode == "push":
        if not ns.prefill_engine_id or not ns.prefill_side_channel:
            p.error("--mode push needs --prefill-engine-id and --prefill-side-channel")
        host, _, port = ns.prefill_side_channel.rpartition(":")
        if not host or not port.isdigit():
            p.error(f"--prefill-side-channel: {ns.prefill_side_channel!r} is not HOST:PORT")
        try:
            peer = NixlPeer(ns.prefill_engine_id, host, int(port), ns.prefill_tp_size)
        except ValueError as exc:
            p.error(str(exc))
    try:
        config = NixlProxyConfig(
            ns.prefill.rstrip("/"),
            ns.decode.rstrip("/"),
            ns.timeout_s,
            mode=ns.mode,
            prefill_nixl=peer,
        )
    except ValueError as exc:
        p.error(str(exc))
    return config, ns.host, ns.port


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the proxy until interrupted."""
    import uvicorn

    config, host, port = parse_args(argv)
    app = create_app(config)
    uvicorn.run(app, host=host, port=port, access_log=False, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
