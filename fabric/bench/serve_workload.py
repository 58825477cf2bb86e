"""Workload of ``fabric bench serve``: prompts built from words, and when to send them.

Prompt lengths are in tokens, fixed (``256``) or uniform in a range
(``128:512``). A prompt is a run of common English words; the first
``shared_prefix`` fraction of every prompt is the same run of words (one
prefix, cut to each prompt's share), the rest is drawn per request::

    prompt i:  | shared prefix (ratio * len_i words) | own words ........ |
    prompt j:  | shared prefix (ratio * len_j)  | own words ...            |

Without a tokenizer, one word counts as one token: the words below are short
and common, so BPE tokenizers (Llama, GPT) give each, with its leading space,
one token; expect a few percent off, plus the chat template's tokens on
``/v1/chat/completions``. With ``--tokenizer-url`` each prompt is tokenized
by the server (vLLM's ``POST /tokenize``) and its word count corrected until
the token count matches.

Arrivals: Poisson at ``rate`` requests/s (exponential gaps, seeded), or all
at once when no rate is given (the sender's concurrency limit paces them).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import model_validator

from fabric.errors import ConfigError
from fabric.settings import Settings

_WORD_TEXT = """
the of and to in is you that it he was for on are as with his they at be this have
from or one had by word but not what all were we when your can said there use an each
which she do how their if will up other about out many then them these so some her
would make like him into time has look two more write go see number no way could
people my than first water been call who oil its now find long down day did get come
made may part
"""
WORDS = tuple(_WORD_TEXT.split())

TOKENIZE_TRIES = 4

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class LengthSpec:
    """Prompt length in tokens: ``low == high`` for a fixed length."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        """``"256"`` (fixed) or ``"128:512"`` (uniform, inclusive)."""
        try:
            parts = [int(p) for p in text.split(":")]
        except ValueError:
            raise ConfigError(f"input tokens: expected N or MIN:MAX, got {text!r}") from None
        if len(parts) not in (1, 2) or min(parts) < 1 or parts[0] > parts[-1]:
            raise ConfigError(
                f"input tokens: expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}"
            )
        return cls(parts[0], parts[-1])

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


class WorkloadConfig(Settings):
    """What to send: how many prompts, how long, how much shared, how fast."""

    num_requests: int = 100
    input_tokens: LengthSpec = LengthSpec(256, 256)
    shared_prefix: float = 0.0
    rate: float | None = None
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> WorkloadConfig:
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        if not 0.0 <= self.shared_prefix <= 1.0:
            raise ValueError(f"shared_prefix: a fraction in [0, 1], got {self.shared_prefix}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate: requests/s must be > 0, got {self.rate}")
        return self


@dataclass(frozen=True)
class Prompt:
    """One request's prompt and its length in tokens (counted or approximated)."""

    text: str
    num_tokens: int
    prefix_tokens: int
    counted: bool


def build_prompts(config: WorkloadConfig, count_tokens: CountTokens | None = None) -> list[Prompt]:
    """``config.num_requests`` prompts; token counts from ``count_tokens`` when given."""
    rng = random.Random(config.seed)
    lengths = [config.input_tokens.draw(rng) for _ in range(config.num_requests)]
    prefix = [rng.choice(WORDS) for _ in range(max(lengths))]
    prompts = []
    for length in lengths:
        shared = round(config.shared_prefix * length)
        own = [rng.choice(WORDS) for _ in range(length - shared)]
        words = prefix[:shared] + own
        if count_tokens is None:
            prompts.append(Prompt(" ".join(words), length, shared, counted=False))
        else:
            prompts.append(_fit(words, length, shared, count_tokens, rng))
    return prompts


def _fit(
    words: list[str], target: int, shared: int, count_tokens: CountTokens, rng: random.Random
) -> Prompt:
    """Grow or cut the prompt's own words until the tokenizer counts ``target``."""
    count = count_tokens(" ".join(words))
    for _ in range(TOKENIZE_TRIES):
        if count == target:
            break
        # NOTE: scale by the measured tokens per word, at least one word each way.
        want = max(1, round(len(words) * target / max(count, 1)))
        if want == len(words):
            want += 1 if count < target else -1
        if want < len(words):
            words = words[: max(1, want)]
        else:
            words = words + [rng.choice(WORDS) for _ in range(want - len(words))]
        count = count_tokens(" ".join(words))
    prefix_tokens = count_tokens(" ".join(words[:shared])) if shared else 0
    return Prompt(" ".join(words), count, min(prefix_tokens, count), counted=True)


def arrival_times(config: WorkloadConfig) -> list[float]:
    """Seconds after the start at which each request is sent (all 0 without a rate)."""
    if config.rate is None:
        return [0.0] * config.num_requests
    rng = random.Random(config.seed + 1)
    t, out = 0.0, []
    for _ in range(config.num_requests):
        out.append(t)
        t += rng.expovariate(config.rate)
    return out


class HttpTokenCounter:
    """Counts tokens with vLLM's ``POST /tokenize`` at ``url`` (base URL or the endpoint)."""

    def __init__(
        self, url: str, model: str, *, timeout: float = 30.0, transport: Any = None
    ) -> None:
        import httpx

        base = url.rstrip("/")
        self.endpoint = base if base.endswith("/tokenize") else base + "/tokenize"
        self.model = model
        self._client = httpx.Client(timeout=timeout, transport=transport)

    def __call__(self, text: str) -> int:
        resp = self._client.post(self.endpoint, json={"model": self.model, "prompt": text})
        resp.raise_for_status()
        body = resp.json()
        return int(body["count"]) if "count" in body else len(body["tokens"])

    def close(self) -> None:
        self._client.close()
