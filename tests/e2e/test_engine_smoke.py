"""A real vLLM CPU engine serves the tiny model, greedily and deterministically.

Later PD tests compare disaggregated output with colocated output token by
token; that only works if greedy decoding gives the same tokens every time,
in every process. This file checks exactly that, plus the basic endpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from fabric.testing.models.tokenizer import BOS_TOKEN
from tests.e2e._engines import Engine, EngineFactory

pytestmark = pytest.mark.e2e

SHORT_PROMPT = "The prefill engine reads the whole prompt"
# NOTE: > 2 blocks of 128 tokens, so a repeat hits vLLM's prefix cache.
LONG_PROMPT = " ".join(f"Chunk {i} of the prompt moves from prefill to decode." for i in range(40))
PROMPTS = (SHORT_PROMPT, LONG_PROMPT)
MAX_TOKENS = 8
LOGPROB_ABS_TOL = 0.02  # two bf16 steps; a prefix-cache hit recomputes fewer tokens


def complete(engine: Engine, prompt: str) -> dict[str, Any]:
    """A greedy completion with token ids and logprobs of the sampled tokens."""
    body = {
        "model": engine.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
    }
    response = httpx.post(engine.url("/v1/completions"), json=body, timeout=120)
    response.raise_for_status()
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def token_ids(choice: dict[str, Any]) -> list[int]:
    return list(choice["token_ids"])


def logprobs(choice: dict[str, Any]) -> list[float]:
    return list(choice["logprobs"]["token_logprobs"])


def assert_same_output(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert token_ids(second) == token_ids(first)
    assert second["prompt_token_ids"] == first["prompt_token_ids"]
    assert logprobs(second) == pytest.approx(logprobs(first), abs=LOGPROB_ABS_TOL)


@pytest.fixture(scope="module")
def engine_pair(engines: EngineFactory, tiny_model_dir: Path) -> tuple[Engine, Engine]:
    """Two independent engine processes, started side by side (~20 s less than in turn)."""
    started = engines.start_many(tiny_model_dir, {"engine-a": {}, "engine-b": {}})
    return started["engine-a"], started["engine-b"]


@pytest.fixture(scope="module")
def engine(engine_pair: tuple[Engine, Engine]) -> Engine:
    """The engine most tests talk to; the other one only checks cross-process equality."""
    return engine_pair[0]


@pytest.fixture(scope="module")
def first_outputs(engine: Engine) -> list[dict[str, Any]]:
    return [complete(engine, prompt) for prompt in PROMPTS]


def test_health_and_models(engine: Engine) -> None:
    assert httpx.get(engine.url("/health"), timeout=10).status_code == 200
    models = httpx.get(engine.url("/v1/models"), timeout=10).json()
    assert [entry["id"] for entry in models["data"]] == [engine.model]


def test_greedy_completion_returns_token_ids(first_outputs: list[dict[str, Any]]) -> None:
    for choice in first_outputs:
        assert len(token_ids(choice)) == MAX_TOKENS
        assert len(logprobs(choice)) == MAX_TOKENS
        assert choice["prompt_token_ids"][0] == 0  # BOS, added once
        assert choice["finish_reason"] == "length"
    assert len(first_outputs[1]["prompt_token_ids"]) > 2 * 128


def test_repeat_gives_same_tokens(engine: Engine, first_outputs: list[dict[str, Any]]) -> None:
    for prompt, first in zip(PROMPTS, first_outputs, strict=True):
        assert_same_output(first, complete(engine, prompt))


def test_chat_template_applied_once(engine: Engine, tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    body = {
        "model": engine.model,
        "messages": [{"role": "user", "content": "What is a KV cache?"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(engine.url("/v1/chat/completions"), json=body, timeout=120)
    response.raise_for_status()
    prompt_ids = response.json()["prompt_token_ids"]
    rendered = (
        f"{BOS_TOKEN}<|start_header_id|>user<|end_header_id|>\n\nWhat is a KV cache?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert prompt_ids == tokenizer.encode(rendered, add_special_tokens=False).ids


def test_other_process_gives_same_tokens(
    engine_pair: tuple[Engine, Engine], first_outputs: list[dict[str, Any]]
) -> None:
    other = engine_pair[1]
    assert other.process.pid != engine_pair[0].process.pid
    for prompt, first in zip(PROMPTS, first_outputs, strict=True):
        assert_same_output(first, complete(other, prompt))
