"""Parsing client requests and deriving the prefill and decode bodies.

The proxy checks only what it relies on (a JSON object with ``model`` and a
``prompt`` or ``messages``, and the types of ``stream``, ``max_tokens`` and
``min_tokens``) and leaves everything else to the engines, which answer
like vLLM does. A request that fails these checks gets a 400 without any
engine being contacted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fabric.router.errors import bad_request

# NOTE: a prefill must not stream (vLLM refuses stream_options without
# stream) and must not be held back by a minimum length.
PREFILL_DROPPED_FIELDS = ("min_tokens", "stream_options", "max_completion_tokens")


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI generation endpoint the proxy splits into prefill + decode."""

    path: str
    input_field: str


COMPLETIONS = Endpoint("/v1/completions", "prompt")
CHAT_COMPLETIONS = Endpoint("/v1/chat/completions", "messages")


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The request's JSON object, checked; raises a 400 ``ProxyError``."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    _check_model(body)
    _check_input(body, endpoint.input_field)
    _check_optional(body, "stream", bool, "a boolean")
    _check_optional_int(body, "max_tokens", minimum=1)
    _check_optional_int(body, "min_tokens", minimum=0)
    return body


def is_stream(body: dict[str, Any]) -> bool:
    """Whether the client asked for a server-sent event stream."""
    return body.get("stream") is True


def prefill_body(body: dict[str, Any], transfer_id: str, decode_kv_endpoint: str) -> dict[str, Any]:
    """What P gets: one token, no stream, and params naming the decoder."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
        "decode_kv_endpoint": decode_kv_endpoint,
    }
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """What D gets: the client's body with P's params (none: D computes the prompt)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def estimate_prompt_tokens(body: dict[str, Any], endpoint: Endpoint) -> int:
    """The prompt's length in tokens, cheaply, without a tokenizer.

    Token ids count exactly; text counts as its UTF-8 bytes // 4 (about four
    bytes per token for English with common BPE vocabularies; an estimate,
    good enough to tell short prompts from long ones). Chat messages count
    their text content only.
    """
    return _count_tokens(body.get(endpoint.input_field))


def _count_tokens(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode()) // 4
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if isinstance(value, list):
        if value and isinstance(value[0], int):
            return len(value)  # token ids: a list is all ids or all prompts
        return sum(_count_tokens(item) for item in value)
    if isinstance(value, dict):
        # A chat message ({"content": str | parts}) or a content part ({"text": str}).
        return _count_tokens(value.get("content")) + _count_tokens(value.get("text"))
    return 0


def dump_json(obj: Any) -> bytes:
    """Compact JSON bytes for an engine request."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _check_model(body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model")


def _check_input(body: dict[str, Any], field: str) -> None:
    value = body.get(field)
    if value is None:
        raise bad_request(f"'{field}' is required", field)
    if field == "prompt" and not isinstance(value, str | list):
        raise bad_request("'prompt' must be a string, a list of strings or of token ids", field)
    if field == "messages" and not isinstance(value, list):
        raise bad_request("'messages' must be a list of messages", field)
    if isinstance(value, list) and not value:
        raise bad_request(f"'{field}' must not be empty", field)


def _check_optional(body: dict[str, Any], field: str, kind: type, what: str) -> None:
    value = body.get(field)
    if value is not None and not isinstance(value, kind):
        raise bad_request(f"'{field}' must be {what}", field)


def _check_optional_int(body: dict[str, Any], field: str, minimum: int) -> None:
    value = body.get(field)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{field}' must be an integer", field)
    if value < minimum:
        raise bad_request(f"'{field}' must be at least {minimum}", field)
