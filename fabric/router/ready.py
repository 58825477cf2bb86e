"""Readiness: every engine answers, and every P->D pair moved KV end to end.

The proxy is ready (``GET /health`` 200, :meth:`Readiness.wait` returns
``[]``) when:

- every engine that is not draining answered its latest ``/health`` probe
  (its fabric side included, see :func:`fabric.router.prefix.fabric_threads_down`);
- at least one decoder can be routed to;
- every pair (P, D) of such engines passed a canary since either of them
  last came back up (an engine's ``epoch``).

Until then ``/health`` is a 503 whose ``missing`` list says what is not
there yet. A canary of the pair (P, D), through the same PD path as a
request::

    GET  D /v1/models                       -> the model id to ask for
    GET  D /metrics                         -> loads_ok, load_failures before
    POST P /v1/completions  {"prompt": "fabric canary <id>", "max_tokens": 1,
                             kv_transfer_params{do_remote_decode, transfer_id,
                             decode_kv_endpoint: D}}   -> P's kv_transfer_params
    POST D /v1/completions  {same body, P's kv_transfer_params}
    GET  D /metrics  (until they move, at most METRICS_WAIT_S)
    passed: vllm:fabric_loads_ok_total rose, vllm:fabric_load_failures_total did not

NOTE: D's own connector counters are the proof that the KV P pushed was
loaded: a decoder that answers without having loaded it (KV lost, refused,
timed out) counts a load failure instead, and one without the connector
exports no such counters (the canary fails, saying so). The prompt is
unique (a random id), so no store holds it and neither engine serves it
from a reuse tier. Canaries to one decoder run one at a time, so a canary
sees its own load; requests that other pairs send to the same decoder
meanwhile move the same counters: a failed load of theirs fails this
canary (failures are checked first; it is retried), and one of theirs
that succeeds could pass a canary whose own load was not counted yet.

Canaries send no ``Authorization``: engines started with an API key answer
them 401, and their pairs are reported failed with that status.

Canaries carry ``x-fabric-canary: 1`` and request ids ``fabric-canary-<hex>``;
they are not client requests (not in ``requests`` counters) but hold their
engines' ``outstanding`` while they run, so a drain waits for them. Draining
or down engines get none.

When they run: readiness is watched from the first time someone asks (a
``GET /health`` or :meth:`Readiness.wait`), so a proxy nobody asks sends no
canary traffic. From then on each background health tick
(``health_interval_s`` > 0), each ``GET /health`` and each round of
:meth:`Readiness.wait` starts the due canaries in the background: a pending
pair whose engines are both up, and a failed pair ``retry_s`` after its last
try.

Routing: a pair whose canary failed is not used (its decoder gets requests
from the other prefillers, or computes the prompt itself when none is
left); pending pairs are (until the first canaries end, the proxy routes as
it would without them). A failed pair does not keep the other pairs from
serving.

A decoder unreachable at start is down: the proxy serves through the other
decoders but is not ready; ``/health`` names it, :meth:`Readiness.wait`
returns it at its timeout. Once a probe sees it answer, its pairs' canaries
run and the proxy turns ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import uuid4

import httpx

from fabric.router.engines import Engine, describe
from fabric.router.requests import decode_body, dump_json, load_json, prefill_body
from fabric.router.transport import Timeouts

if TYPE_CHECKING:
    from fabric.router.state import ProxyState

logger = logging.getLogger(__name__)

CANARY_TIMEOUT_S = 60.0
"""The most one canary may take (``proxy.request_deadline_s`` when shorter)."""
RETRY_S = 5.0
"""A failed pair's canary is tried again this long after its last try."""
METRICS_WAIT_S = 2.0
"""How long a decoder's load counters may take to show the canary's load."""
WAIT_POLL_S = 0.5

CANARY_HEADER = "x-fabric-canary"
LOADS_OK = "vllm:fabric_loads_ok_total"
LOAD_FAILURES = "vllm:fabric_load_failures_total"
COMPLETIONS = "/v1/completions"


class PairState(enum.Enum):
    """Whether a P->D pair is known to move KV."""

    PENDING = "pending"  # not checked since its engines (re)started
    OK = "ok"
    FAILED = "failed"


class CanaryFailed(Exception):
    """A canary step failed; the message says which and why."""


@dataclass(eq=False)
class Pair:
    """One prefiller and one decoder, and what their last canary found."""

    prefill: Engine
    decode: Engine
    result: PairState = PairState.PENDING
    error: str | None = None
    checked_at: float | None = None  # wall clock of the last canary's end
    epochs: tuple[int, int] | None = None  # the engines' epochs it was checked at
    next_try: float = 0.0  # loop time

    @property
    def name(self) -> str:
        return f"{self.prefill.name} -> {self.decode.name}"

    @property
    def current(self) -> bool:
        """Whether its result is about the engines as they run now."""
        return self.epochs == (self.prefill.epoch, self.decode.epoch)

    @property
    def state(self) -> PairState:
        return self.result if self.current else PairState.PENDING

    def as_dict(self) -> dict[str, Any]:
        state = self.state
        return {
            "prefill": self.prefill.name,
            "decode": self.decode.name,
            "state": state.value,
            "error": self.error if state is PairState.FAILED else None,
            "checked_at": self.checked_at,
        }


class Readiness:
    """The readiness of one proxy (see the module docstring); on ``ProxyState.readiness``."""

    def __init__(self, state: ProxyState) -> None:
        self._state = state
        pool = state.pool
        self.pairs = [Pair(p, d) for d in pool.decoders for p in pool.prefillers]
        self._by_engines = {(pair.prefill, pair.decode): pair for pair in self.pairs}
        self.active = False  # someone asked: canaries run from now on
        self.retry_s = RETRY_S
        self.timeout_s = min(CANARY_TIMEOUT_S, state.config.request_deadline_s)
        self.in_flight = 0  # canaries running
        self._pass: asyncio.Task[None] | None = None
        self._locks: dict[Engine, asyncio.Lock] = {}  # one canary per decoder at a time

    def usable(self, prefill: Engine, decode: Engine) -> bool:
        """Whether requests may go from ``prefill`` to ``decode`` (not a failed pair)."""
        pair = self._by_engines.get((prefill, decode))
        return pair is None or pair.state is not PairState.FAILED

    @property
    def ready(self) -> bool:
        return not self.missing()

    def missing(self) -> list[str]:
        """What keeps the proxy from being ready, one line each (``[]``: ready)."""
        pool = self._state.pool
        out = []
        for engine in pool.engines:
            if engine.draining:
                continue
            if not engine.healthy:
                out.append(f"{engine.name}: down ({engine.last_error})")
            elif not engine.answered:
                out.append(f"{engine.name}: has not answered /health yet")
        if not any(d.routable for d in pool.decoders):
            out.append("no decoder to route to (every one is down or draining)")
        for pair in self.pairs:
            p, d = pair.prefill, pair.decode
            if p.draining or d.draining or not (p.healthy and d.healthy):
                continue  # NOTE: a down engine is reported above; a draining one is not needed
            state = pair.state
            if state is PairState.PENDING:
                out.append(f"{pair.name}: canary pending")
            elif state is PairState.FAILED:
                out.append(f"{pair.name}: canary failed: {pair.error}")
        return out

    def kick(self) -> None:
        """Watch readiness from now on, and start the due canaries in the background."""
        self.active = True
        if (self._pass is None or self._pass.done()) and self._due():
            self._pass = asyncio.create_task(self._run_due(), name="fabric-proxy-canaries")

    def tick(self) -> None:
        """A background health tick: the due canaries, once readiness is watched."""
        if self.active:
            self.kick()

    async def wait(self, timeout_s: float) -> list[str]:
        """Probe the engines and run the due canaries until ready (``[]``) or
        ``timeout_s`` passed (what is still missing)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._state.probe_engines()
            self.kick()
            running = self._pass
            if running is not None and not running.done():
                await asyncio.wait({running}, timeout=max(0.0, deadline - loop.time()))
            missing = self.missing()
            left = deadline - loop.time()
            if not missing or left <= 0:
                return missing
            await asyncio.sleep(min(WAIT_POLL_S, left))

    async def close(self) -> None:
        """Cancel the canaries in flight."""
        task, self._pass = self._pass, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _due(self) -> list[Pair]:
        now = asyncio.get_running_loop().time()
        return [
            pair
            for pair in self.pairs
            if (pair.state is not PairState.OK)
            and (not pair.current or now >= pair.next_try)
            and all(e.routable and e.answered for e in (pair.prefill, pair.decode))
        ]

    async def _run_due(self) -> None:
        await asyncio.gather(*(self._canary(pair) for pair in self._due()))

    async def _canary(self, pair: Pair) -> None:
        lock = self._locks.setdefault(pair.decode, asyncio.Lock())
        async with lock:
            epochs = (pair.prefill.epoch, pair.decode.epoch)
            self.in_flight += 1
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._transfer(pair.prefill, pair.decode)
                error = None
            except TimeoutError:
                error = f"no end within {self.timeout_s:g} s"
            except CanaryFailed as exc:
                error = str(exc)
            except httpx.HTTPError as exc:
                error = describe(exc)
            except Exception as exc:  # NOTE: a canary's bug fails that canary, not the loop
                logger.exception("canary %s: unexpected error", pair.name)
                error = f"proxy error: {describe(exc)}"
            finally:
                self.in_flight -= 1
            self._record(pair, epochs, error)

    def _record(self, pair: Pair, epochs: tuple[int, int], error: str | None) -> None:
        was = pair.state
        pair.result = PairState.OK if error is None else PairState.FAILED
        pair.error, pair.epochs, pair.checked_at = error, epochs, time.time()
        pair.next_try = asyncio.get_running_loop().time() + self.retry_s
        counters = self._state.counters
        if error is None:
            counters.canaries += 1
            logger.info("canary %s: KV moved end to end", pair.name)
        else:
            counters.canary_failures += 1
            if was is not PairState.FAILED:
                logger.warning("canary %s failed (pair not used): %s", pair.name, error)

    async def _transfer(self, prefill: Engine, decode: Engine) -> None:
        """One canary through ``prefill`` and ``decode``; CanaryFailed says what went wrong."""
        assert decode.kv_endpoint is not None  # EnginePool checks decoders have one
        model = await self._model(decode)
        before = await self._loads(decode)
        transfer_id = f"fabric-canary-{uuid4().hex}"
        body = {
            "model": model,
            "prompt": f"fabric canary {transfer_id}",
            "max_tokens": 1,
            "temperature": 0.0,
        }
        headers = {
            "content-type": "application/json",
            "x-request-id": transfer_id,
            "accept-encoding": "identity",
            CANARY_HEADER: "1",
        }
        content = dump_json(prefill_body(body, transfer_id, decode.kv_endpoint))
        state = self._state
        answer = await self._post(prefill, content, headers, state.prefill_timeouts)
        params = _params(answer)
        if params is None:
            raise CanaryFailed(
                f"{prefill.name} returned no kv_transfer_params (is the fabric connector loaded?)"
            )
        content = dump_json(decode_body(body, params))
        await self._post(decode, content, headers, state.decode_timeouts)
        await self._loaded(decode, prefill, before)

    async def _post(
        self, engine: Engine, content: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> bytes:
        state = self._state
        engine.outstanding += 1
        try:
            response, payload = await state.engines.post_read(
                engine.url + COMPLETIONS, content, headers, timeouts, state.max_answer_bytes
            )
        finally:
            engine.outstanding -= 1
        if not response.is_success:
            text = payload[:200].decode(errors="replace")
            raise CanaryFailed(f"{engine.name} answered HTTP {response.status}: {text}")
        return payload

    async def _model(self, decode: Engine) -> str:
        """The first model ``decode`` serves (``/v1/models``)."""
        response = await self._get(decode, "/v1/models")
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, LookupError, TypeError) as exc:
            raise CanaryFailed(f"{decode.name}: /v1/models names no model") from exc

    async def _loads(self, decode: Engine) -> tuple[float, float]:
        """``decode``'s (loads_ok, load_failures) counters."""
        text = (await self._get(decode, "/metrics")).text
        ok, failures = _metric(text, LOADS_OK), _metric(text, LOAD_FAILURES)
        if ok is None:
            raise CanaryFailed(
                f"{decode.name} exports no {LOADS_OK} on /metrics (is the fabric connector loaded?)"
            )
        return ok, failures or 0.0

    async def _loaded(self, decode: Engine, prefill: Engine, before: tuple[float, float]) -> None:
        """Until ``decode``'s counters show the load (or a failure); CanaryFailed if not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + METRICS_WAIT_S
        while True:
            ok, failures = await self._loads(decode)
            if failures > before[1]:
                raise CanaryFailed(
                    f"{decode.name} could not load the KV {prefill.name} pushed "
                    f"({LOAD_FAILURES} rose; see {decode.name}'s log)"
                )
            if ok > before[0]:
                return
            if loop.time() >= deadline:
                raise CanaryFailed(
                    f"{decode.name} answered but counted no KV load from {prefill.name} "
                    f"({LOADS_OK} did not rise within {METRICS_WAIT_S:g} s)"
                )
            await asyncio.sleep(0.05)

    async def _get(self, engine: Engine, path: str) -> httpx.Response:
        state = self._state
        response = await state.client.get(engine.url + path, timeout=state.config.health_timeout_s)
        if response.status_code != 200:
            raise CanaryFailed(f"{engine.name}: {path} answered HTTP {response.status_code}")
        return response


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
