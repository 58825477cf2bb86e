"""``fabric bench serve``: load an OpenAI-compatible endpoint and time its answers.

::

    prompts + arrival times (serve_workload)
        |  one httpx.AsyncClient; at most `concurrency` requests in flight
        v
    POST /v1/completions or /v1/chat/completions (stream or not)
        |  per request: send time, first text chunk, every later text chunk, end
        v
    TTFT, ITL, end-to-end latency (p50/p90/p99/mean), requests/s, tokens/s, errors

TTFT: from sending the request to the first streamed chunk that carries
text. ITL: the gaps between consecutive text chunks of a request, over all
requests (vLLM streams one token per chunk unless it falls behind; then a
gap spans several). Output tokens come from the ``usage`` the server
returns (streams ask for it with ``stream_options.include_usage``), else one
per text chunk. Without streaming only end-to-end latency is measured. The
rates divide by the wall time from the first send to the last answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import httpx

from pydantic import Field, model_validator

from fabric.bench.serve_workload import Prompt, WorkloadConfig, arrival_times
from fabric.settings import Settings

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_ERRORS_KEPT = 5


class ServeConfig(Settings):
    """Where to send and how: endpoint, generation length, streaming, concurrency."""

    url: str = "http://127.0.0.1:8000"
    model: str = "tiny"
    endpoint: str = "/v1/completions"
    max_tokens: int = 64
    stream: bool = True
    concurrency: int | None = None
    ignore_eos: bool = False
    timeout_s: float = 300.0
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: {self.endpoint!r} is not one of {ENDPOINTS}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http(s)://HOST:PORT, got {self.url!r}")
        return self

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    @property
    def max_in_flight(self) -> int | None:
        """The concurrency cap: as given; 1 when neither it nor a rate is given."""
        if self.concurrency is None and self.workload.rate is None:
            return 1
        return self.concurrency


@dataclass
class RequestResult:
    """What one request did; times in seconds from its send."""

    ok: bool
    sent_at: float
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def request_body(config: ServeConfig, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": config.max_tokens,
        "stream": config.stream,
        "temperature": 0.0,
    }
    if config.chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True  # NOTE: vLLM's extension: always generate max_tokens
    return body


def chunk_text(obj: dict[str, Any]) -> str:
    """The text a completion or chat chunk (or full answer) carries."""
    text = []
    for choice in obj.get("choices") or []:
        if "text" in choice:
            text.append(choice.get("text") or "")
        else:
            part = choice.get("delta") or choice.get("message") or {}
            text.append(part.get("content") or "")
    return "".join(text)


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream, split on ``\\n`` only: a completion's text
    may hold U+2028 or U+0085, which ``aiter_lines`` (``str.splitlines``)
    would split a JSON event at."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buffer:
        yield buffer.rstrip("\r")


async def send_one(client: Any, config: ServeConfig, prompt: Prompt, t0: float) -> RequestResult:
    """Send one request and time it; errors become a failed result, never raise."""
    start = time.perf_counter()
    result = RequestResult(ok=False, sent_at=start - t0, e2e_s=0.0, prompt_tokens=prompt.num_tokens)
    try:
        if config.stream:
            await _stream(client, config, prompt, start, result)
        else:
            await _whole(client, config, prompt, result)
    except Exception as exc:  # NOTE: a benchmark counts failures, it does not stop
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    result.ok = result.error is None
    return result


async def _stream(
    client: Any, config: ServeConfig, prompt: Prompt, start: float, result: RequestResult
) -> None:
    body = request_body(config, prompt)
    chunks, last = 0, start
    async with client.stream("POST", config.endpoint, json=body) as resp:
        if resp.status_code != 200:
            result.error = (
                f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
            )
            return
        async for line in sse_lines(resp):
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                result.error = f"stream error: {obj['error']}"
                return
            _take_usage(obj, result)
            if chunk_text(obj):
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last, chunks = now, chunks + 1
    if not result.output_tokens:
        result.output_tokens = chunks


async def _whole(client: Any, config: ServeConfig, prompt: Prompt, result: RequestResult) -> None:
    resp = await client.post(config.endpoint, json=request_body(config, prompt))
    if resp.status_code != 200:
        result.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
        return
    obj = resp.json()
    _take_usage(obj, result)
    if not result.output_tokens and chunk_text(obj):
        result.output_tokens = len(chunk_text(obj).split())


def _take_usage(obj: dict[str, Any], result: RequestResult) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        result.output_tokens = int(usage.get("completion_tokens") or result.output_tokens)
        result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)


async def run_requests(
    config: ServeConfig, prompts: list[Prompt]
) -> tuple[list[RequestResult], float]:
    """Send every prompt at its arrival time, within the concurrency cap; (results, wall s)."""
    import httpx

    cap = config.max_in_flight
    gate = asyncio.Semaphore(cap) if cap else None
    conns = min(cap or len(prompts), 1000)
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    arrivals = arrival_times(config.workload)
    async with httpx.AsyncClient(
        base_url=config.url, timeout=config.timeout_s, limits=limits
    ) as client:
        t0 = time.perf_counter()

        async def one(prompt: Prompt, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            if gate is None:
                return await send_one(client, config, prompt, t0)
            async with gate:
                return await send_one(client, config, prompt, t0)

        results = await asyncio.gather(
            *(one(p, at) for p, at in zip(prompts, arrivals, strict=True))
        )
        wall = time.perf_counter() - t0
    return list(results), wall


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/mean in milliseconds, and the sample count."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    ms = np.asarray(values, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
        "mean": round(float(ms.mean()), 3),
        "n": int(ms.size),
    }


def summarize(config: ServeConfig, results: list[RequestResult], wall: float) -> dict[str, Any]:
    """The report: latencies, rates and errors (see the module docstring)."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    end = max((r.sent_at + r.e2e_s for r in results), default=wall)
    first = min((r.sent_at for r in results), default=0.0)
    span = max(end - first, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    config_doc = config.model_dump()
    config_doc["workload"]["input_tokens"] = str(config.workload.input_tokens)
    return {
        "benchmark": "serve",
        "config": config_doc,
        "requests": len(results),
        "completed": len(ok),
        "errors": {
            "count": len(failed),
            "first": [r.error for r in failed[:MAX_ERRORS_KEPT]],
        },
        "duration_s": round(span, 4),
        "requests_per_s": round(len(ok) / span, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / span, 3),
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": percentiles([r.e2e_s for r in ok]),
    }


def run_serve_bench(config: ServeConfig, prompts: list[Prompt]) -> dict[str, Any]:
    """Run the benchmark to completion (its own event loop); the summary."""
    results, wall = asyncio.run(run_requests(config, prompts))
    return summarize(config, results, wall)
