"""One canary: a KV transfer through a P->D pair, and what it proves.

A canary of the pair (P, D), through the same PD path as a request::

    GET  D /v1/models                       -> the model id to ask for
    GET  D /metrics                         -> loads_ok, load_failures before
    POST P /v1/completions  {"prompt": "fabric canary <id>", "max_tokens": 1,
                             kv_transfer_params{do_remote_decode, transfer_id,
                             decode_kv_endpoint: D}}   -> P's kv_transfer_params
    POST D /v1/completions  {same body, P's kv_transfer_params}
    GET  D /metrics  (until they move, at most METRICS_WAIT_S)
    passed: vllm:fabric_loads_ok_total rose, vllm:fabric_load_failures_total did not

Its outcome is one of three (:func:`run_canary`):

- passed (None): D's connector counted the load;
- :class:`CanaryFailed`, only on evidence that the transfer is broken: D's
  ``load_failures`` rose, P answered without ``kv_transfer_params`` (no
  connector), or an engine refused the PD request itself (an HTTP error a
  client's request through the pair would get too: 400, 404, 500, ...);
- :class:`CanaryUnverified` when the canary could not tell: an engine
  asked for credentials (401/403), was busy or draining (408, 429, 503,
  504), timed out or could not be reached, D exports no fabric counters
  (no connector, or its stats are off: ``--disable-log-stats``), or they
  did not move within ``METRICS_WAIT_S`` (Prometheus lag under load).

NOTE: D's own connector counters are the proof that the KV P pushed was
loaded: a decoder that answers without having loaded it (KV lost, refused,
timed out) counts a load failure instead. The prompt is unique (a random
id), so no store holds it and neither engine serves it from a reuse tier.
Canaries to one decoder run one at a time (:mod:`fabric.router.ready`), so a
canary sees its own load; requests that other pairs send to the same
decoder meanwhile move the same counters: a failed load of theirs fails
this canary (failures are checked first; it is retried), and one of theirs
that succeeds could pass a canary whose own load was not counted yet.

Credentials: vLLM's ``--api-key`` guards ``/v1`` (``/metrics`` and
``/health`` are open: ``vllm/entrypoints/serve/middleware/authenticate.py``
``GUARDED_PREFIX``). A canary sends ``Authorization: Bearer <key>`` with the
key the topology gives each engine (:func:`fabric.router.engines.api_key`:
its ``--api-key`` arg, ``VLLM_API_KEY`` in its env or the proxy's). Without
one, an engine started with a key answers 401 and its pairs stay
unverified (routed, but the proxy is not ready).

Canaries carry ``x-fabric-canary: 1`` and request ids ``fabric-canary-<hex>``;
they are not client requests (not in ``requests`` counters) but hold their
engines' ``outstanding`` while they run, so a drain waits for them.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any
from uuid import uuid4

import httpx

from fabric.router.engines import Engine, is_drain_refusal
from fabric.router.requests import decode_body, dump_json, load_json, prefill_body
from fabric.router.transport import Timeouts

if TYPE_CHECKING:
    from fabric.router.state import ProxyState

METRICS_WAIT_S = 2.0
"""How long a decoder's load counters may take to show the canary's load."""
METRICS_POLL_S = 0.05

CANARY_HEADER = "x-fabric-canary"
LOADS_OK = "vllm:fabric_loads_ok_total"
LOAD_FAILURES = "vllm:fabric_load_failures_total"
COMPLETIONS = "/v1/completions"

UNVERIFIED_STATUSES = frozenset({401, 403, 408, 429, 503, 504})
"""Engine answers that say nothing of the transfer: credentials, busy, draining."""


class CanaryFailed(Exception):
    """The canary showed the pair's transfer is broken; the message says how."""


class CanaryUnverified(Exception):
    """The canary could not tell whether the pair moves KV; the message says why."""


async def run_canary(state: ProxyState, prefill: Engine, decode: Engine) -> None:
    """One canary through ``prefill`` and ``decode`` (see the module docstring)."""
    assert decode.kv_endpoint is not None  # EnginePool checks decoders have one
    model = await _model(state, decode)
    before = await _loads(state, decode)
    transfer_id = f"fabric-canary-{uuid4().hex}"
    body = {
        "model": model,
        "prompt": f"fabric canary {transfer_id}",
        "max_tokens": 1,
        "temperature": 0.0,
    }
    content = dump_json(prefill_body(body, transfer_id, decode.kv_endpoint))
    answer = await _post(state, prefill, content, transfer_id, state.prefill_timeouts)
    params = _params(answer)
    if params is None:
        raise CanaryFailed(
            f"{prefill.name} returned no kv_transfer_params (is the fabric connector loaded?)"
        )
    content = dump_json(decode_body(body, params))
    await _post(state, decode, content, transfer_id, state.decode_timeouts)
    await _loaded(state, decode, prefill, before)


def _headers(engine: Engine, transfer_id: str) -> dict[str, str]:
    headers = {
        "content-type": "application/json",
        "x-request-id": transfer_id,
        "accept-encoding": "identity",
        CANARY_HEADER: "1",
    }
    if engine.api_key:
        headers["authorization"] = f"Bearer {engine.api_key}"
    return headers


async def _post(
    state: ProxyState, engine: Engine, content: bytes, transfer_id: str, timeouts: Timeouts
) -> bytes:
    engine.outstanding += 1
    try:
        response, payload = await state.engines.post_read(
            engine.url + COMPLETIONS,
            content,
            _headers(engine, transfer_id),
            timeouts,
            state.max_answer_bytes,
        )
    finally:
        engine.outstanding -= 1
    if not response.is_success:
        raise _refusal(engine, response.status, payload)
    return payload


def _refusal(engine: Engine, status: int, payload: bytes) -> Exception:
    """What an engine's error answer to a canary shows."""
    text = payload[:200].decode(errors="replace")
    if is_drain_refusal(status, payload):
        engine.saw_draining()
        return CanaryUnverified(f"{engine.name} is draining (HTTP 503)")
    if status in UNVERIFIED_STATUSES:
        return CanaryUnverified(f"{engine.name} answered HTTP {status}{_hint(status)}: {text}")
    return CanaryFailed(f"{engine.name} answered HTTP {status}: {text}")


async def _model(state: ProxyState, decode: Engine) -> str:
    """The first model ``decode`` serves (``/v1/models``)."""
    response = await _get(state, decode, "/v1/models")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, LookupError, TypeError) as exc:
        raise CanaryUnverified(f"{decode.name}: /v1/models names no model") from exc


async def _loads(state: ProxyState, decode: Engine) -> tuple[float, float]:
    """``decode``'s (loads_ok, load_failures) counters."""
    text = (await _get(state, decode, "/metrics")).text
    ok, failures = _metric(text, LOADS_OK), _metric(text, LOAD_FAILURES)
    if ok is None:
        raise CanaryUnverified(
            f"{decode.name} exports no {LOADS_OK} on /metrics (no fabric connector, "
            "or its stats are off: --disable-log-stats)"
        )
    return ok, failures or 0.0


async def _loaded(
    state: ProxyState, decode: Engine, prefill: Engine, before: tuple[float, float]
) -> None:
    """Until ``decode``'s counters show the load: CanaryFailed on a load
    failure, CanaryUnverified if they do not move in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + METRICS_WAIT_S
    while True:
        ok, failures = await _loads(state, decode)
        if failures > before[1]:
            raise CanaryFailed(
                f"{decode.name} could not load the KV {prefill.name} pushed "
                f"({LOAD_FAILURES} rose; see {decode.name}'s log)"
            )
        if ok > before[0]:
            return
        if loop.time() >= deadline:
            raise CanaryUnverified(
                f"{decode.name} answered but its {LOADS_OK} did not move within "
                f"{METRICS_WAIT_S:g} s (metrics lag?)"
            )
        await asyncio.sleep(METRICS_POLL_S)


async def _get(state: ProxyState, engine: Engine, path: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {engine.api_key}"} if engine.api_key else None
    response = await state.client.get(
        engine.url + path, headers=headers, timeout=state.config.health_timeout_s
    )
    if response.status_code != 200:
        status = response.status_code
        raise CanaryUnverified(f"{engine.name}: {path} answered HTTP {status}{_hint(status)}")
    return response


def _hint(status: int) -> str:
    if status in (401, 403):
        return " (started with --api-key? the topology gives the proxy no key for it)"
    return ""


def _params(answer: bytes) -> dict[str, Any] | None:
    try:
        params = load_json(answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and params else None


_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{[^}]*\})?\s+(?P<value>\S+)", re.M)


def _metric(text: str, name: str) -> float | None:
    """The sum of a Prometheus metric's samples (over its labels); None if absent."""
    total = None
    for match in _SAMPLE.finditer(text):
        if match.group("name") == name:
            try:
                value = float(match.group("value"))
            except ValueError:
                continue
            total = (total or 0.0) + value
    return total
