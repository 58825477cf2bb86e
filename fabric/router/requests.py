"""Parsing client requests and deriving the prefill and decode bodies.

The proxy checks only what it relies on and leaves everything else (other
sampling parameters, unknown fields) to the engines, which answer like vLLM
does. What it checks:

- the body: UTF-8 (or UTF-16/32) JSON, no NaN/Infinity nor numbers past a
  float's range, nested at most as deep as Python's parser allows, an
  object, at most ``proxy.max_body_bytes`` long (else a 413);
- ``model``: a non-empty string;
- ``prompt``: a string, or a non-empty list of strings, of token ids, or of
  non-empty token id lists; token ids are ints in ``[0, 2**31)``;
- ``messages``: a non-empty list of objects with a string ``role`` and a
  ``content`` that is a string, a list of parts or null;
- ``max_tokens``/``max_completion_tokens`` (>= 1), ``min_tokens`` (>= 0):
  integers below ``2**31``; ``stream``: a boolean; ``stream_options``: an
  object (null stands for absent everywhere).

A request that fails these checks gets a 400 without any engine being
contacted; the admin routes (:mod:`fabric.router.controller`) use the same
checks.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from fabric.router.errors import bad_request

MAX_INT32 = 2**31 - 1
MAX_ESTIMATE_DEPTH = 4
# A surrogate escape, or the UTF-8 bytes of a surrogate (json decodes with surrogatepass).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")

# NOTE: a prefill must not stream (vLLM refuses stream_options without
# stream) and must not be held back by a minimum length.
PREFILL_DROPPED_FIELDS = ("min_tokens", "stream_options", "max_completion_tokens")

_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI generation endpoint the proxy splits into prefill + decode."""

    path: str
    input_field: str


COMPLETIONS = Endpoint("/v1/completions", "prompt")
CHAT_COMPLETIONS = Endpoint("/v1/chat/completions", "messages")


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The request's JSON object, checked; raises a 400 ``ProxyError``."""
    body = load_json_object(raw)
    _check_model(body)
    _check_input(body, endpoint.input_field)
    _check_optional(body, "stream", bool, "a boolean")
    _check_optional(body, "stream_options", dict, "an object")
    _check_optional_int(body, "max_tokens", minimum=1)
    _check_optional_int(body, "max_completion_tokens", minimum=1)
    _check_optional_int(body, "min_tokens", minimum=0)
    return body


def load_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` parsed as a JSON object; a 400 ``ProxyError`` for anything else.

    NOTE: msgspec parses the usual body (UTF-8, no lone surrogates) several
    times faster than the stdlib; whatever it refuses goes through the
    stdlib's parser, whose answers and error messages define what the proxy
    accepts (UTF-16/32 and a BOM too). Numbers too large for a float (1e400)
    are refused by both, as NaN and Infinity are: JSON cannot carry them on.
    """
    try:
        body = _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        body = _load_json_stdlib(raw)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def load_json(raw: bytes) -> Any:
    """Any JSON value (an engine's answer): msgspec, or the stdlib for what it refuses.

    Raises ``ValueError`` (the stdlib's) for bytes that are not JSON.
    """
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(raw)


def _load_json_stdlib(raw: bytes) -> Any:
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise bad_request("request body is nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    if _MAYBE_SURROGATE.search(raw) or json.detect_encoding(raw) != "utf-8":
        dump_json(body)  # NOTE: only then can a lone surrogate be in it; a 400 if so
    return body


def check_known_fields(body: dict[str, Any], known: tuple[str, ...]) -> None:
    """A 400 naming the first field of ``body`` not in ``known`` (admin routes)."""
    for name in body:
        if name not in known:
            raise bad_request(f"unknown field {name!r}; known: {list(known)}", name)


def check_prompt(value: Any, field: str = "prompt") -> None:
    """A string, or a non-empty list of strings, token ids or token id lists."""
    what = (
        f"'{field}' must be a string, or a non-empty list of strings, "
        "of token ids or of lists of token ids"
    )
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not value:
        raise bad_request(what, field)
    first = value[0]
    if isinstance(first, str):
        if not all(isinstance(item, str) for item in value):
            raise bad_request(what, field)
    elif isinstance(first, list):
        for item in value:
            if not isinstance(item, list) or not item:
                raise bad_request(what, field)
            check_token_ids(item, field)
    else:
        check_token_ids(value, field)


def check_token_ids(value: list[Any], field: str) -> None:
    """Every item an int (not a bool) in ``[0, 2**31)``."""
    # NOTE: set(map(type, ...)) and min/max run at C speed; a per-item
    # Python loop would cost ~3 ms per 100k-token prompt.
    if set(map(type, value)) != {int}:
        raise bad_request(f"'{field}' token ids must be integers", field)
    if min(value) < 0 or max(value) > MAX_INT32:
        raise bad_request(f"'{field}' token ids must be in [0, {MAX_INT32}]", field)


def check_messages(value: Any, field: str = "messages") -> None:
    """A non-empty list of ``{"role": str, "content": str | list | null, ...}``."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{field}' must be a non-empty list of messages", field)
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"each of '{field}' must be an object with a string 'role'", field)
        if not isinstance(message.get("content"), str | list | None):
            raise bad_request("a message's 'content' must be a string or a list of parts", field)


def is_stream(body: dict[str, Any]) -> bool:
    """Whether the client asked for a server-sent event stream."""
    return body.get("stream") is True


def prefill_body(body: dict[str, Any], transfer_id: str, decode_kv_endpoint: str) -> dict[str, Any]:
    """What P gets: one token, no stream, and params naming the decoder."""
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
        "decode_kv_endpoint": decode_kv_endpoint,
    }
    return one_token_body(body, params)


def one_token_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """``body`` for a prefill-only call: one token, no stream, ``kv_transfer_params``."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = kv_transfer_params
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
    return _count_tokens(body.get(endpoint.input_field), 0)


def _count_tokens(value: Any, depth: int) -> int:
    if depth > MAX_ESTIMATE_DEPTH:  # deeper than any valid prompt: not counted
        return 0
    if isinstance(value, str):
        return len(value.encode(errors="replace")) // 4
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if isinstance(value, list):
        if value and isinstance(value[0], int):
            return len(value)  # token ids: a list is all ids or all prompts
        return sum(_count_tokens(item, depth + 1) for item in value)
    if isinstance(value, dict):
        # A chat message ({"content": str | parts}) or a content part ({"text": str}).
        content, text = value.get("content"), value.get("text")
        return _count_tokens(content, depth + 1) + _count_tokens(text, depth + 1)
    return 0


def dump_json(obj: Any) -> bytes:
    """Compact JSON bytes for an engine request; a 400 for text UTF-8 cannot carry."""
    try:
        return _ENCODER.encode(obj)
    except UnicodeEncodeError as exc:
        raise bad_request(
            "request text holds a lone UTF-16 surrogate (U+D800..U+DFFF), which UTF-8 cannot carry"
        ) from exc
    except (TypeError, OverflowError, ValueError):
        pass  # NOTE: e.g. P's params holding something msgspec does not write: as the stdlib does
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def decode_content(
    raw: bytes, body: dict[str, Any], kv_transfer_params: dict[str, Any] | None
) -> bytes:
    """D's request bytes: :func:`decode_body` of ``body``, written without re-serialising it.

    NOTE: the client's bytes are valid UTF-8 JSON (``raw`` parsed to
    ``body``); when they carry no ``kv_transfer_params`` of their own, D
    gets them as they are, with P's params appended as the object's last
    member. Anything else is written anew.
    """
    if "kv_transfer_params" in body or json.detect_encoding(raw) != "utf-8":
        return dump_json(decode_body(body, kv_transfer_params))
    if kv_transfer_params is None:
        return raw
    end = raw.rstrip().rindex(b"}")
    return b'%b,"kv_transfer_params":%b}' % (raw[:end], dump_json(kv_transfer_params))


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
    if field == "prompt":
        check_prompt(value)
    else:
        check_messages(value)


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
    if value > MAX_INT32:
        raise bad_request(f"'{field}' must be at most {MAX_INT32}", field)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
