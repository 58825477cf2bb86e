"""The first token from the prefiller (``proxy.first_token: prefiller``).

In vLLM's PD flow the decoder, once the prompt's KV is loaded, computes the
prompt's last token again and samples the first token from it: a full
prompt hit sets ``num_computed_tokens = num_tokens - 1``
(``vllm/v1/core/sched/scheduler.py:3170-3172``, vLLM 0.32). The client's
first token therefore waits for the whole handoff plus one decoder step
(44-95 ms at 1k-4k tokens on the benchmark's CPU engines), although the
prefiller sampled that very token when its prefill ended (its answer has
``max_tokens`` 1).

With ``first_token: prefiller`` the proxy streams the prefiller's token to
the client as soon as P answers, and then the decoder's stream from its
second token on. The decoder still samples its own first token (its seeded
generator draws as a colocated engine's would, and its usage counts it);
the proxy checks it against P's before relaying anything after it:

- equal (token id, and P's text a prefix of D's first event's text): D's
  first token is taken out of its stream (the rest of that event, if any,
  goes on) and every later event is relayed with the first event's ``id``,
  ``created`` and ``model``;
- different (counted ``first_token_mismatches``): P's token has reached the
  client and D's continuation does not follow it, so nothing more of D's
  stream is relayed. D's request is dropped and D gets another, from P's
  token on: the prompt's token ids with P's token appended, ``max_tokens``
  and ``min_tokens`` one less, no ``kv_transfer_params`` (D's prefix cache
  holds the prompt it just loaded; vLLM primes its detokenizer with the
  whole prompt, so the text goes on where P's token left it); its stream
  is relayed as the rest of the answer, its usage counted as the client's
  request (``first_token_continuations``). Only where the rest means the
  same with P's token in the prompt: greedy requests (a seeded one's
  restarted generator would reuse, on vLLM's V1 model runner, the draw
  that picked P's token), with :data:`CONTINUABLE_FIELDS` only, not after
  a first token with an empty text, and with no server-side cap on output
  tokens below the request's (``--override-generation-config``: the proxy
  cannot see it, and P's token plus D's rest would be one more); else, or
  if D refuses, an error event ends the stream. A D whose budget was one
  token (its first event ends for length) ends the answer with P's token.
  Never a token that does not follow the ones before it.

  Why they can differ: the same rule on the same logits is not the same
  logits. P's come from the prefill, D's from a one-token step over the
  loaded KV, and a near tie can flip between the two (seen on this
  project's CPU engines with a random tiny model: P's token was the
  colocated engine's, D's the one vLLM's NIXL stacks returned).

Only where P's token is the one D samples, and the proxy can splice the
two streams exactly: a PD request (early handoff, where D's own token can
come first and then goes first, or sequential, where D starts after P
answered), a streamed
``/v1/completions`` request for one prompt with ``n`` 1, greedy
(``temperature`` 0) or seeded, without ``echo``, ``logprobs``,
``prompt_logprobs``, ``suffix``, stop strings (D holds back text that may
begin one), beam search or continuous usage, and with room for a second
token (``max_tokens`` absent or >= 2). At run time P's answer must hold
exactly one token, whose text does not end in a partial character (U+FFFD:
D's stream holds such bytes back; an empty text, a special token's or the
start of a character, is D's too), and finish for length (a stop token or
EOS ends the request there: D's own stream says so). Anything else, and a
D whose first token arrives before P's answer (D recomputed on its own), is
relayed as D sends it. Chat completions keep D's first token for now
(their first events depend on the server's reasoning and tool parsers).

Both P and D are asked ``return_token_ids`` (how the proxy tells tokens
apart); a client that did not ask gets ``token_ids`` and
``prompt_token_ids`` as null, as vLLM writes them. The proxy's
``first_token_lag_seconds`` summary is how long after P's answer D's own
first token reached the proxy (the handoff as the proxy sees it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from fabric.router.requests import COMPLETIONS, Endpoint, is_stream

REFUSED_FIELDS = ("logprobs", "prompt_logprobs", "suffix")
"""Fields whose presence (anything but null; ``logprobs: 0`` asks for logprobs
too) keeps D's first token."""
REFUSED_FLAGS = ("echo", "use_beam_search")
"""Flags that keep D's first token unless null or false."""

REPLACEMENT = "\ufffd"
_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


def eligible(body: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether P's first token may go to the client first (see the module docstring)."""
    if endpoint is not COMPLETIONS or not is_stream(body):
        return False
    if any(body.get(name) is not None for name in REFUSED_FIELDS):
        return False
    if any(body.get(name) is not None and body.get(name) is not False for name in REFUSED_FLAGS):
        return False
    if body.get("return_token_ids") not in (None, True, False):
        return False  # NOTE: e.g. "false", which vLLM reads as false: not told apart here
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if body.get("stop") not in (None, "", []):
        return False
    options = body.get("stream_options") or {}
    if options.get("continuous_usage_stats"):
        return False
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and max_tokens < 2:
        return False
    if not _one_prompt(body.get("prompt")):
        return False
    return _is_number(body.get("temperature"), 0) or _is_int(body.get("seed"))


def _one_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if isinstance(prompt[0], int):
        return True  # token ids (checked by the request parser)
    return len(prompt) == 1


def _is_number(value: Any, equal: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == equal


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class FirstToken:
    """The token P sampled, from its (non-streamed) answer, and when it came."""

    token_id: int
    text: str
    prompt_token_ids: list[int] | None
    id: str
    created: int
    model: str
    at: float  # loop time P's answer was read

    @classmethod
    def of(cls, answer: Any, at: float) -> FirstToken | None:
        """P's token, or None when it may not go first (see the module docstring)."""
        if not isinstance(answer, dict):
            return None
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        ids, text = choice.get("token_ids"), choice.get("text")
        if not isinstance(ids, list) or len(ids) != 1 or not _is_int(ids[0]):
            return None
        if not isinstance(text, str) or text.endswith(REPLACEMENT):
            return None
        if choice.get("finish_reason") != "length":
            return None
        name, created, model = answer.get("id"), answer.get("created"), answer.get("model")
        if not isinstance(name, str) or not isinstance(created, int) or not isinstance(model, str):
            return None
        prompt_ids = choice.get("prompt_token_ids")
        if not (isinstance(prompt_ids, list) and all(_is_int(t) for t in prompt_ids)):
            prompt_ids = None
        return cls(ids[0], text, prompt_ids, name, created, model, at)

    def event(self, want_ids: bool) -> bytes:
        """P's token as the event vLLM streams for a completion's first token."""
        choice = {
            "index": 0,
            "text": self.text,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
            "prompt_token_ids": self.prompt_token_ids if want_ids else None,
            "token_ids": [self.token_id] if want_ids else None,
        }
        chunk = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        return b"data: " + _ENCODER.encode(chunk) + b"\n\n"


class Mismatch(Exception):
    """D's first token is not the one P's stream already gave the client."""


CONTINUABLE_FIELDS = frozenset(
    (
        "model", "prompt", "max_tokens", "min_tokens", "temperature", "seed", "top_p", "top_k",
        "min_p", "repetition_penalty", "logit_bias", "allowed_token_ids", "stop_token_ids",
        "ignore_eos", "skip_special_tokens", "stream", "stream_options", "return_token_ids",
        "cache_salt", "priority", "user", "request_id", "add_special_tokens",
        "kv_transfer_params", "n", "best_of", "echo", "logprobs", "prompt_logprobs", "suffix",
        "use_beam_search", "stop",
    )
)  # fmt: skip
"""The request fields whose meaning does not change when P's token moves from
the output into the prompt. Not among them, so a mismatch ends the stream:
``frequency_penalty``/``presence_penalty``, ``bad_words`` and repetition
detection count output tokens only; structured outputs would start their
grammar anew after P's token; ``truncate_prompt_tokens`` would cut the
prompt again; and whatever vLLM adds (an allowlist does not go stale).
(``n``, ``echo``, ``stop`` ... are here only as their eligible values.)"""
DEFAULT_MAX_TOKENS = 16
"""vLLM's ``max_tokens`` for a completion that names none
(``vllm/entrypoints/openai/completion/protocol.py:63``, vLLM 0.32)."""


def continuation(body: dict[str, Any], first: FirstToken) -> dict[str, Any] | None:
    """D's request for the answer after P's token (see the module docstring);
    None when it would not be the same answer's rest.

    Not for a first token with an empty text: it may be part of a character,
    and vLLM's detokenizer, primed with a prompt that ends in one, emits the
    whole prompt's text with the next (tokenizers' ``DecodeStream`` sets no
    prefix on a text ending in U+FFFD); not without P's prompt token ids; not
    with ``max_tokens`` null (the server's generation config decides it).
    """
    if first.prompt_token_ids is None or not first.text:
        return None
    if not _is_number(body.get("temperature"), 0):
        return None  # NOTE: seeded: a restarted generator's draws are not the seed's (V1 runner)
    if any(name not in CONTINUABLE_FIELDS for name in body):
        return None
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or max_tokens < 2:
        return None
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    out["prompt"] = [*first.prompt_token_ids, first.token_id]
    out["stream"] = out["return_token_ids"] = True
    out["max_tokens"] = max_tokens - 1
    if isinstance(min_tokens := body.get("min_tokens"), int) and min_tokens > 0:
        out["min_tokens"] = min_tokens - 1
    return out


class Splice:
    """D's stream, as events, after P's token (or instead of it).

    :meth:`feed` takes D's bytes as they arrive and returns the events to
    relay. Before :meth:`sent_first`, D's events go on as D wrote them (but
    for the token ids the client did not ask for); after it, D's first token
    is checked against P's and taken out.
    """

    def __init__(self, want_ids: bool, after: FirstToken | None = None) -> None:
        """``after``: the stream of a request continuing from P's token (no
        first token to take out; its prompt and usage hold P's token)."""
        self.want_ids = want_ids
        self.first: FirstToken | None = after  # P's, once sent
        self.joined = after is not None  # D's first token seen (after P's, or instead)
        self.continuing = after is not None
        self.ended_on_other = False  # D's one-token answer was another token than P's
        self._buffer = bytearray()
        self._scanned = 0  # NOTE: where the next search for an event's end starts

    def sent_first(self, first: FirstToken) -> None:
        """P's token went to the client (before any token of D's)."""
        assert not self.joined
        self.first = first

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events of D's that ``chunk`` completes, rewritten; raises :class:`Mismatch`.

        NOTE: linear in the bytes fed: an event of many chunks (a first event
        with a long prompt's ids) is searched and copied once.
        """
        buffer = self._buffer
        buffer += chunk
        end = buffer.rfind(b"\n\n", self._scanned)
        if end < 0:
            self._scanned = max(0, len(buffer) - 1)
            return []
        events = bytes(buffer[:end]).split(b"\n\n")
        del buffer[: end + 2]
        self._scanned = max(0, len(buffer) - 1)
        return [out for event in events if (out := self._event(event)) is not None]

    def rest(self) -> bytes:
        """Bytes of D's after its last complete event (relayed as they are)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data: {"):
            return event + b"\n\n"
        try:
            chunk = _DECODER.decode(event[6:])
        except msgspec.DecodeError:
            return event + b"\n\n"
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list):
            return event + b"\n\n"  # NOTE: an error event, or not vLLM's: as it is
        for choice in choices:
            if isinstance(choice, dict) and self._choice(choice) is None:
                return None
            if self.continuing and isinstance(choice, dict):
                choice["prompt_token_ids"] = None  # NOTE: P's event carried the client's
        usage = chunk.get("usage")
        if self.continuing and isinstance(usage, dict):
            # NOTE: P's token is in the continuation's prompt; the client's request made it
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                usage["prompt_tokens"], usage["completion_tokens"] = prompt - 1, completion + 1
        if self.first is not None:
            first = self.first
            chunk["id"], chunk["created"], chunk["model"] = first.id, first.created, first.model
        return b"data: " + _ENCODER.encode(chunk) + b"\n\n"

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """``choice`` rewritten in place; None to drop its event."""
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            ids = []
        if not self.joined and (ids or choice.get("text")):
            self.joined = True
            if self.first is not None and not self._take_first(choice, ids):
                return None
        if not self.want_ids:
            choice["token_ids"] = None
            choice["prompt_token_ids"] = None
        return choice

    def _take_first(self, choice: dict[str, Any], ids: list[Any]) -> bool:
        """Take P's token out of D's first; False when nothing else is left."""
        first = self.first
        assert first is not None
        text = choice.get("text")
        if not ids or ids[0] != first.token_id or not isinstance(text, str):
            text = None
        if text is None or not text.startswith(first.text):
            if len(ids) == 1 and choice.get("finish_reason") == "length":
                # NOTE: the request's budget was one token: P's is the answer
                choice["token_ids"], choice["text"], choice["prompt_token_ids"] = [], "", None
                self.ended_on_other = True
                return True
            raise Mismatch(
                f"the decoder's first token ({ids[:1]!r}, {choice.get('text')!r}) is not the "
                f"prefiller's ({first.token_id}, {first.text!r}), which the stream already gave"
            )
        choice["token_ids"] = ids[1:]
        choice["text"] = text[len(first.text) :]
        choice["prompt_token_ids"] = None
        return bool(ids[1:] or choice["text"] or choice.get("finish_reason"))
