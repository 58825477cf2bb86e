"""Shared pieces of the PD e2e tests: engine configs, the in-process proxy,
requests with token ids and logprobs, Prometheus scraping."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from typing import Any

import httpx
import pytest

from fabric.config import parse_topology
from fabric.launch.process import free_port

CHUNK_TOKENS = 256  # vLLM CPU block size is 128: 2 blocks per chunk
# shorter than a chunk, exact multiples, partial last chunks, more than 4 chunks
PROMPT_LENGTHS = [3, 40, 127, 128, 255, 256, 257, 300, 384, 511, 512, 513, 700, 768]
PROMPT_LENGTHS += [1024, 1100, 1300, 1536, 1800, 2000]
MAX_TOKENS = 6
LOGPROB_ABS_TOL = 0.01  # one bf16 step; measured: 0.0003 on the tiny model
FALLBACK_BOUND_S = 60.0


# NOTE: tests count reuse hits on two shared cores, where a worker busy packing
# or reading its disk tier can miss the default 2 ms lookup bound (a miss is
# correct, but breaks the count); test_pd keeps the default.
E2E_LOOKUP_TIMEOUT_MS = 2000


def kv_config(role: str, **extra: Any) -> dict[str, Any]:
    options = {
        "chunk_tokens": CHUNK_TOKENS,
        "store_mib": 256,
        "lookup_timeout_ms": E2E_LOOKUP_TIMEOUT_MS,
    }
    return {
        "kv_connector": "FabricConnector",
        "kv_connector_module_path": "fabric.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": options | extra,
    }


class Proxy:
    """The fabric proxy app served by uvicorn in a thread of the test process."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[tuple[str, int]],
        **proxy: Any,
    ) -> None:
        """``prefill``: engine URLs; ``decode``: (engine URL, kv_port) pairs."""
        import uvicorn

        from fabric.router.app import create_app

        settings = {"port": None, "prefill_timeout_s": 120, "decode_timeout_s": 180} | proxy
        topology = parse_topology(
            {
                "prefill": [{"name": f"p{i}", "url": url} for i, url in enumerate(prefill)],
                "decode": [
                    {"name": f"d{i}", "url": url, "kv_port": kv_port}
                    for i, (url, kv_port) in enumerate(decode)
                ],
                "proxy": settings,
            }
        )
        self.port = free_port()
        config = uvicorn.Config(
            create_app(topology), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.05)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def prompt_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(length)]


def body(prompt: list[int], *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
        "stream": stream,
    }


def chat_body(text: str, *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "return_token_ids": True,
        "stream": stream,
    }


def _choice_logprobs(choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    if "token_logprobs" in logprobs:  # completions
        return list(logprobs["token_logprobs"] or [])
    return [entry["logprob"] for entry in logprobs.get("content") or []]  # chat


def complete(
    url: str, payload: dict[str, Any], *, timeout: float = 300
) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of the generated tokens (completions or chat,
    streamed or not)."""
    if not payload.get("stream"):
        response = httpx.post(url, json=payload, timeout=timeout)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return list(choice["token_ids"]), _choice_logprobs(choice)
    ids: list[int] = []
    lps: list[float] = []
    with httpx.stream("POST", url, json=payload, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                ids += choice.get("token_ids") or []
                lps += _choice_logprobs(choice)
    return ids, lps


def metric(engine_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    text = httpx.get(engine_url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def assert_same(
    got: tuple[list[int], list[float]],
    want: tuple[list[int], list[float]],
    tol: float = LOGPROB_ABS_TOL,
) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=tol)


BATCHED_LOGPROB_ABS_TOL = 0.1  # batch-dependent numerics: several bf16 steps
NEAR_TIE_GAP = 0.2


def assert_same_up_to_near_tie(
    got: tuple[list[int], list[float]],
    want: tuple[list[int], list[float]],
    *,
    tol: float = BATCHED_LOGPROB_ABS_TOL,
    gap: float = NEAR_TIE_GAP,
) -> bool:
    """Greedy outputs produced under different batching: equal, or equal up
    to a near tie. Returns whether they are exactly equal.

    vLLM's numerics depend on the batch a request shares, so when two tokens
    are almost equally likely the argmax can flip, and after a flip the two
    continuations are unrelated. Accepted: the same tokens with logprobs
    within ``tol`` up to the first difference, and at the difference each
    side's chosen token is about as likely as the other side's (within
    ``gap``: a near tie, as wrong KV would not give). Rejected: different
    lengths, logprobs apart before any difference, or a flip between tokens
    whose logprobs are far apart.
    """
    (got_ids, got_lps), (want_ids, want_lps) = got, want
    assert len(got_ids) == len(want_ids) == len(got_lps) == len(want_lps) > 0
    flip = next(
        (i for i, (a, b) in enumerate(zip(got_ids, want_ids, strict=True)) if a != b),
        None,
    )
    end = len(got_ids) if flip is None else flip
    assert got_lps[:end] == pytest.approx(want_lps[:end], abs=tol), (got, want)
    if flip is None:
        return True
    assert abs(got_lps[flip] - want_lps[flip]) <= gap, (
        f"token {flip} differs and is no near tie: {got_ids[flip]} at {got_lps[flip]:.3f}"
        f" vs {want_ids[flip]} at {want_lps[flip]:.3f}"
    )
    return False
