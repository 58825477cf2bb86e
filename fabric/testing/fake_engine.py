"""A fake engine that speaks enough of vLLM's OpenAI API to drive the proxy.

``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE stream),
``/v1/models``, ``/tokenize`` and ``/health``, answering at once with
deterministic tokens (a function of the prompt only, so a decoder's answer
is the same with or without remote KV). With ``api_key`` it guards ``/v1``
as vLLM's ``--api-key`` does (401 without ``Authorization: Bearer <key>``).
A prefiller that gets ``kv_transfer_params`` with ``do_remote_decode``
answers with the params a fabric prefiller returns::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "transfer_id": ..., "num_tokens": N, "prefill_kv_endpoint": "tcp://..."}

A decoder that gets a prefiller's params counts the "load" on ``/metrics``
as a fabric decoder does (``vllm:fabric_loads_ok_total``, or
``vllm:fabric_load_failures_total`` when the push "failed": a prefiller
with ``push_fails`` or a decoder with ``load_fails``), so the proxy's
readiness canaries (:mod:`fabric.router.ready`) can pass or fail.

It records the requests it saw (``GET /fake/requests``, ``DELETE`` clears),
so tests can check what P and D were sent; canaries (header
``x-fabric-canary``) are recorded apart, in ``FakeEngineState.canaries``.
Knobs inject failures: a delay before answering, slow tokens, a slow
``/health`` (a busy engine), a fixed error status, a prefiller without
params, failed pushes or loads, an answer padded to a size, no fabric
metrics.

Run it: ``python -m fabric.testing.fake_engine --port N --role prefill|decode``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import uuid4

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from fabric.settings import Settings
from fabric.testing.fake_kv import FakeKvPort

DEFAULT_MAX_TOKENS = 16
CANARY_HEADER = "x-fabric-canary"


class FakeEngineConfig(Settings):
    """How a fake engine behaves.

    ``delay_s``: wait before answering a generation request (timeouts).
    ``token_delay_s``: wait between streamed tokens. ``health_delay_s``: wait
    before answering ``/health`` (a busy engine). ``fail_status``: answer
    every generation request with this HTTP status. ``kv_params``: False makes
    a prefiller that returns no ``kv_transfer_params`` (no connector).
    ``push_fails``: a prefiller whose params say its push failed (its
    decoders count a load failure). ``load_fails``: a decoder that counts
    every load as failed. ``fabric_metrics``: False leaves the fabric
    counters off ``/metrics`` (an engine without the connector).
    ``count_loads``: False exports the counters but never moves them (a
    decoder whose metrics lag).
    ``serve_kv``: a decoder serves its ``kv_endpoint`` (:mod:`fabric.router.
    fake_kv`): it records the proxy's early-handoff word, and a request
    admitted at dispatch (params without ``num_tokens``) waits for it as a
    fabric decoder's load does: ``done`` counts a load, ``failed`` or a
    word that runs out a load failure (then it "recomputes": the same answer).
    ``refuse_words``: its kv port refuses the word (an older fabric decoder).
    ``stream_at_once``: a streamed request admitted at dispatch starts its
    stream at once and waits inside it, as vLLM's server does (its headers
    go before the engine has a token); else it waits before answering.
    ``first_token_delay_s``: a stream waits this long before its first
    token (after that wait: a decoder computing the prompt's last token).
    ``first_token_differs``: a decoder whose first token of a
    remote-prefilled request is not the one a prefiller samples (numerics
    that differ between the two). ``plain_fail_status``: answer this status
    to a request without ``kv_transfer_params`` (a decoder that serves PD
    requests only). ``stream_error``: a stream sends this
    error event (and ``[DONE]``) at once, before any token or wait.
    ``return_token_ids`` in a request adds
    ``token_ids`` (and ``prompt_token_ids``) to each choice: a token's id
    is its number.
    ``pad_bytes``: a non-streamed answer carries this many extra bytes.
    ``api_key``: the key ``/v1`` routes require. ``tokenize_delay_s``: wait
    before answering ``/tokenize``; ``tokenize_text``: answer it 200 with
    this text instead of token ids; ``tokenize_status``: answer it this
    error status instead.
    """

    role: Literal["prefill", "decode", "both"] = "decode"
    name: str = "fake"
    model: str = "fake"
    kv_endpoint: str | None = None
    delay_s: float = 0.0
    token_delay_s: float = 0.0
    health_delay_s: float = 0.0
    fail_status: int | None = None
    kv_params: bool = True
    push_fails: bool = False
    load_fails: bool = False
    fabric_metrics: bool = True
    count_loads: bool = True
    pad_bytes: int = 0
    api_key: str | None = None
    tokenize_delay_s: float = 0.0
    tokenize_text: str | None = None
    tokenize_status: int | None = None
    max_recorded: int = 1000
    serve_kv: bool = False
    refuse_words: bool = False
    first_token_differs: bool = False
    stream_at_once: bool = False
    first_token_delay_s: float = 0.0
    stream_error: str | None = None
    plain_fail_status: int | None = None


@dataclass
class FakeEngineState:
    """The config, the requests seen (newest last, bounded) and the load counters."""

    config: FakeEngineConfig
    seen: deque[dict[str, Any]] = field(default_factory=deque)
    canaries: deque[dict[str, Any]] = field(default_factory=deque)
    loads_ok: int = 0
    load_failures: int = 0
    tokenized: int = 0  # /tokenize calls
    kv: FakeKvPort | None = None  # serve_kv: the control port
    early: dict[str, str] = field(default_factory=dict)  # transfer -> how its wait ended

    def record(self, path: str, request: Request, body: Any) -> None:
        """Remember one generation request (a canary apart)."""
        seen = self.canaries if request.headers.get(CANARY_HEADER) else self.seen
        if len(seen) >= self.config.max_recorded:
            seen.popleft()
        seen.append({"path": path, "request_id": request.headers.get("x-request-id"), "body": body})

    def count_load(self, body: Any) -> None:
        """A decoder given a prefiller's params: count its "load"."""
        if self.config.role == "prefill" or not self.config.count_loads:
            return
        if not isinstance(body, dict):
            return
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        if self.config.load_fails or params.get("fake_push_failed"):
            self.load_failures += 1
        else:
            self.loads_ok += 1

    def metrics(self) -> str:
        """``/metrics``: the fabric load counters, as a fabric decoder exports them."""
        if not self.config.fabric_metrics:
            return "# no fabric connector\n"
        lines = []
        for name, value in (
            ("loads_ok", self.loads_ok),
            ("load_failures", self.load_failures),
        ):
            metric = f"vllm:fabric_{name}_total"
            lines += [
                f"# TYPE {metric} counter",
                f'{metric}{{engine="0",model_name="{self.config.model}"}} {float(value)}',
            ]
        return "\n".join(lines) + "\n"


def create_fake_engine(config: FakeEngineConfig) -> FastAPI:
    """The fake engine's app; its state is ``app.state.fake``."""
    state = FakeEngineState(config)
    app = FastAPI(
        title=f"fabric fake engine {config.name}", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.fake = state
    if config.serve_kv and config.kv_endpoint and config.role != "prefill":
        kv = state.kv = FakeKvPort(config.kv_endpoint, refuse_words=config.refuse_words)
        app.router.on_shutdown.append(kv.close)

    async def completions(request: Request) -> Response:
        return _unauthorized(state, request) or await _generate(state, request, chat=False)

    async def chat(request: Request) -> Response:
        return _unauthorized(state, request) or await _generate(state, request, chat=True)

    async def tokenize(request: Request) -> Response:
        state.tokenized += 1
        if state.config.tokenize_delay_s:
            await asyncio.sleep(state.config.tokenize_delay_s)
        if state.config.tokenize_text is not None:
            return PlainTextResponse(state.config.tokenize_text)
        if state.config.tokenize_status is not None:
            return _error(state.config.tokenize_status, "tokenize is failing on purpose")
        body = json.loads(await request.body())
        prompt = body.get("prompt", body.get("messages"))
        tokens = [zlib.crc32(word.encode()) % 50000 for word in json.dumps(prompt).split()]
        return JSONResponse({"tokens": tokens, "count": len(tokens)})

    async def models(request: Request) -> Response:
        if (refused := _unauthorized(state, request)) is not None:
            return refused
        card = {
            "id": config.model,
            "object": "model",
            "created": 0,
            "owned_by": "fabric-fake",
            "root": config.model,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if config.health_delay_s:
            await asyncio.sleep(config.health_delay_s)
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(state.metrics())

    async def requests(request: Request) -> Response:
        if request.method == "DELETE":
            state.seen.clear()
        return JSONResponse(list(state.seen))

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/tokenize", tokenize, methods=["POST"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    app.add_route("/fake/requests", requests, methods=["GET", "DELETE"])
    return app


def _unauthorized(state: FakeEngineState, request: Request) -> Response | None:
    """vLLM's answer to a ``/v1`` request without the key, or None."""
    key = state.config.api_key
    if key is None or request.headers.get("authorization") == f"Bearer {key}":
        return None
    return JSONResponse({"error": "Unauthorized"}, 401)


async def _generate(state: FakeEngineState, request: Request, *, chat: bool) -> Response:
    config = state.config
    try:
        body = json.loads(await request.body())
    except ValueError:
        return _error(400, "invalid JSON")
    state.record(request.url.path, request, body)
    if config.delay_s:
        await asyncio.sleep(config.delay_s)
    if config.fail_status is not None:
        return _error(config.fail_status, f"{config.name} is failing on purpose")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    if body.get("model") != config.model:
        return _error(404, f"The model `{body.get('model')}` does not exist.")
    if config.plain_fail_status is not None and "kv_transfer_params" not in body:
        return _error(config.plain_fail_status, f"{config.name} serves PD requests only")
    params = body.get("kv_transfer_params")
    early = state.kv is not None and isinstance(params, dict) and _early(params)
    answer = _Answer.of(state.config, body, chat)
    if not early:
        state.count_load(body)
    elif not (body.get("stream") and config.stream_at_once):
        await _wait_early(state, params)
    if body.get("stream") and config.stream_error is not None:
        error = {"error": {"message": config.stream_error, "type": "InternalServerError"}}
        events = [b"data: " + json.dumps(error).encode() + b"\n\n", b"data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")
    if body.get("stream"):
        wait = _wait_early(state, params) if early and config.stream_at_once else None
        return StreamingResponse(
            _stream(answer, config.token_delay_s, wait, config.first_token_delay_s),
            media_type="text/event-stream",
        )
    full = answer.full()
    if config.pad_bytes:
        full["padding"] = "x" * config.pad_bytes
    return JSONResponse(full)


async def _wait_early(state: FakeEngineState, params: Any) -> None:
    """As a fabric decoder admitted at dispatch: wait for the word, count the load."""
    assert state.kv is not None
    tid = str(params["transfer_id"])
    state.early[tid] = outcome = await state.kv.wait_prefill(tid, timeout_s=60)
    if outcome == "done" and not state.config.load_fails:
        state.loads_ok += 1
    else:
        state.load_failures += 1


@dataclass
class _Answer:
    """One generated answer, rendered as JSON or as stream chunks."""

    chat: bool
    model: str
    tokens: list[str]
    prompt_tokens: int
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None
    token_ids: list[int] | None = None  # return_token_ids: each token's id
    prompt_token_ids: list[int] | None = None
    id: str = field(default_factory=lambda: uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, config: FakeEngineConfig, body: dict[str, Any], chat: bool) -> _Answer:
        prompt = body.get("messages") if chat else body.get("prompt")
        max_tokens = body.get("max_tokens") or DEFAULT_MAX_TOKENS
        options = body.get("stream_options") or {}
        tokens = fake_tokens(prompt, max_tokens)
        params = body.get("kv_transfer_params")
        if (
            config.first_token_differs
            and isinstance(params, dict)
            and params.get("do_remote_prefill")
        ):
            tokens[0] = f" t{(int(tokens[0][2:]) + 1) % 1000}"
        ids = [int(token[2:]) for token in tokens] if body.get("return_token_ids") else None
        return cls(
            chat=chat,
            model=config.model,
            tokens=tokens,
            prompt_tokens=count_prompt_tokens(prompt),
            include_usage=bool(options.get("include_usage")),
            kv_transfer_params=_returned_params(config, body, count_prompt_tokens(prompt)),
            token_ids=ids,
            prompt_token_ids=list(range(count_prompt_tokens(prompt))) if ids is not None else None,
        )

    def full(self) -> dict[str, Any]:
        """The non-streaming answer."""
        text = "".join(self.tokens)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice.update(finish_reason="length", stop_reason=None)
        if self.token_ids is not None:
            choice.update(token_ids=self.token_ids, prompt_token_ids=self.prompt_token_ids)
        out = self._head("chat.completion" if self.chat else "text_completion")
        return {
            **out,
            "choices": [choice],
            "usage": self.usage(),
            "kv_transfer_params": self.kv_transfer_params,
        }

    def chunks(self) -> list[dict[str, Any]]:
        """The streamed answer, one chunk per token (plus usage when asked)."""
        out = [self._chunk(i, token) for i, token in enumerate(self.tokens)]
        if self.include_usage:
            out.append({**self._head(self._chunk_object()), "choices": [], "usage": self.usage()})
        return out

    def usage(self) -> dict[str, int]:
        """Token counts as vLLM reports them."""
        n = len(self.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
        }

    def _chunk(self, i: int, token: str) -> dict[str, Any]:
        last = i == len(self.tokens) - 1
        if self.chat:
            delta = {"role": "assistant", "content": token} if i == 0 else {"content": token}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": token, "logprobs": None}
        choice.update(finish_reason="length" if last else None, stop_reason=None)
        if self.token_ids is not None:
            prompt_ids = self.prompt_token_ids if i == 0 else None
            choice.update(token_ids=[self.token_ids[i]], prompt_token_ids=prompt_ids)
        return {**self._head(self._chunk_object()), "choices": [choice]}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {
            "id": f"{prefix}-{self.id}",
            "object": obj,
            "created": self.created,
            "model": self.model,
        }


async def _stream(
    answer: _Answer,
    token_delay_s: float,
    wait: Awaitable[None] | None = None,
    first_token_delay_s: float = 0.0,
) -> AsyncIterator[bytes]:
    if wait is not None:
        await wait
    if first_token_delay_s:
        await asyncio.sleep(first_token_delay_s)
    for chunk in answer.chunks():
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        if token_delay_s:
            await asyncio.sleep(token_delay_s)
    yield b"data: [DONE]\n\n"


def fake_tokens(prompt: Any, max_tokens: int) -> list[str]:
    """``max_tokens`` deterministic tokens, a function of the prompt only."""
    seed = zlib.crc32(json.dumps(prompt, sort_keys=True).encode())
    return [f" t{(seed + i * 7919) % 1000}" for i in range(max_tokens)]


def count_prompt_tokens(prompt: Any) -> int:
    """A stand-in token count: words of text, length of token id lists."""
    if isinstance(prompt, str):
        return max(1, len(prompt.split()))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(count_prompt_tokens(p) for p in prompt)
    if isinstance(prompt, dict):
        return count_prompt_tokens(prompt.get("content") or "")
    return 1


def _early(params: Any) -> bool:
    """Whether ``params`` are an early handoff's (the proxy's, no ``num_tokens``)."""
    return (
        isinstance(params, dict)
        and bool(params.get("do_remote_prefill"))
        and isinstance(params.get("transfer_id"), str)
        and "num_tokens" not in params
    )


def _returned_params(
    config: FakeEngineConfig, body: dict[str, Any], num_tokens: int
) -> dict[str, Any] | None:
    params = body.get("kv_transfer_params")
    if config.role == "decode" or not config.kv_params or not isinstance(params, dict):
        return None
    if not params.get("do_remote_decode"):
        return None
    returned = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": params.get("transfer_id"),
        "num_tokens": num_tokens,
        "prefill_kv_endpoint": config.kv_endpoint,
    }
    if config.push_fails:
        returned["fake_push_failed"] = True
    return returned


def _error(status: int, message: str) -> Response:
    error = {
        "message": message,
        "type": "BadRequestError" if status < 500 else "InternalServerError",
        "param": None,
        "code": status,
    }
    return JSONResponse({"error": error}, status)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options of ``python -m fabric.testing.fake_engine``."""
    p = argparse.ArgumentParser(
        prog="python -m fabric.testing.fake_engine", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="decode")
    p.add_argument("--name", default="fake")
    p.add_argument("--model", default="fake")
    p.add_argument("--kv-port", type=int, help="names tcp://HOST:KV_PORT as this engine's endpoint")
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--token-delay-s", type=float, default=0.0)
    p.add_argument("--health-delay-s", type=float, default=0.0, help="a busy engine's /health")
    p.add_argument("--fail-status", type=int)
    p.add_argument("--no-kv-params", action="store_true", help="a prefiller without the connector")
    p.add_argument("--push-fails", action="store_true", help="a prefiller whose pushes fail")
    p.add_argument("--load-fails", action="store_true", help="a decoder whose loads fail")
    return p.parse_args(argv)


def config_from_args(ns: argparse.Namespace) -> FakeEngineConfig:
    """The engine config the options describe."""
    kv_endpoint = f"tcp://{ns.host}:{ns.kv_port}" if ns.kv_port else None
    return FakeEngineConfig(
        role=ns.role,
        name=ns.name,
        model=ns.model,
        kv_endpoint=kv_endpoint,
        delay_s=ns.delay_s,
        token_delay_s=ns.token_delay_s,
        health_delay_s=ns.health_delay_s,
        fail_status=ns.fail_status,
        kv_params=not ns.no_kv_params,
        push_fails=ns.push_fails,
        load_fails=ns.load_fails,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Serve a fake engine until interrupted."""
    import uvicorn

    ns = parse_args(argv)
    app = create_fake_engine(config_from_args(ns))
    uvicorn.run(app, host=ns.host, port=ns.port, access_log=False, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
