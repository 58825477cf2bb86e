"""2P2D on real vLLM: concurrent mixed traffic, then a decoder dies.

The reference outputs come from prefiller 0 serving the same requests on
its own before any PD traffic (a colocated run). The PD runs then also
exercise prefillers whose prefix cache already holds the prompt.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabric.launch.process import free_port
from tests.e2e._engines import Engine, EngineFactory
from tests.e2e._pd import (
    Proxy,
    assert_same,
    assert_same_up_to_near_tie,
    body,
    chat_body,
    complete,
    kv_config,
    metric,
    prompt_ids,
)

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 40
MARKED_DOWN_WITHIN_S = 5.0


class XPyD:
    def __init__(self, engines: EngineFactory, model_dir: Path) -> None:
        self.kv_ports = [free_port(), free_port()]
        specs: dict[str, dict[str, Any]] = {
            "p0": {"cpu_cores": "0", "kv_transfer_config": kv_config("kv_producer")},
            "p1": {"cpu_cores": "1", "kv_transfer_config": kv_config("kv_producer")},
        }
        for i, kv_port in enumerate(self.kv_ports):
            config = kv_config("kv_consumer", kv_port=kv_port)
            specs[f"d{i}"] = {"cpu_cores": str(i), "kv_transfer_config": config}
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(engines.start, model_dir, name=name, **kw)
                for name, kw in specs.items()
            }
            self.engines: dict[str, Engine] = {n: f.result() for n, f in futures.items()}
        self.prefill = [self.engines["p0"], self.engines["p1"]]
        self.decode = [self.engines["d0"], self.engines["d1"]]
        self.proxy = Proxy(
            [e.base_url for e in self.prefill],
            [(e.base_url, port) for e, port in zip(self.decode, self.kv_ports, strict=True)],
            health_interval_s=1.0,
        )
        try:
            self.wait_ready()
        except BaseException:
            self.proxy.stop()
            raise

    def wait_ready(self, timeout_s: float = 180) -> None:
        """Until the proxy's ``/health`` is 200: every engine answers and every
        pair passed its canary, as ``fabric up`` waits before it reports the
        deployment up (so each P->D link exists before the burst)."""
        deadline, last = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            try:
                answer = httpx.get(self.proxy.url("/health"), timeout=30)
            except httpx.TransportError as exc:
                last = repr(exc)
            else:
                if answer.status_code == 200:
                    return
                last = answer.text
            time.sleep(0.5)
        raise AssertionError(f"the proxy never got ready: {last}")


@pytest.fixture(scope="module")
def xpyd(engines: EngineFactory, tiny_model_dir: Path) -> Iterator[XPyD]:
    cluster = XPyD(engines, tiny_model_dir)
    yield cluster
    cluster.proxy.stop()


def workload(seed: int) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) of NUM_REQUESTS mixed requests: completions and chat, streamed and not."""
    rng = random.Random(seed)
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(NUM_REQUESTS):
        stream = i % 4 in (1, 3)
        if i % 2 == 0:
            out.append(
                ("/v1/completions", body(prompt_ids(rng.randint(20, 1500), seed * 1000 + i)))
            )
        else:
            words = " ".join(f"w{rng.randint(0, 999)}" for _ in range(rng.randint(5, 400)))
            out.append(("/v1/chat/completions", chat_body(f"request {i}: {words}")))
        out[-1][1]["stream"] = stream
    return out


def reference(engine: Engine, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    return [complete(engine.url(path), payload | {"stream": False}) for path, payload in requests]


def run_concurrently(proxy: Proxy, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(complete, proxy.url(path), payload) for path, payload in requests]
        return [f.result(timeout=600) for f in futures]


def test_40_concurrent_mixed_requests_correct_and_spread_over_both_p_and_d(xpyd: XPyD) -> None:
    """40 concurrent completions and chats, streamed and not, against the
    same requests served one at a time by a colocated engine.

    vLLM's numerics depend on batch composition, so under 40-way batching a
    near-tie argmax can flip (seen: token 6 of one request, logprobs 0.05
    apart): every output must equal the colocated one up to such a near tie
    (``assert_same_up_to_near_tie``), and most must be exactly equal.
    """
    requests = workload(seed=1)
    want = reference(xpyd.prefill[0], requests)
    unspread = []
    for _ in range(BURST_TRIES):
        xpyd.wait_ready()  # NOTE: every pair checked, so the policy may use each
        loads_before = [metric(d.base_url, "vllm:fabric_loads_ok_total") for d in xpyd.decode]
        sent_before = [metric(p.base_url, "vllm:fabric_chunks_sent_total") for p in xpyd.prefill]
        got = run_concurrently(xpyd.proxy, requests)
        exact = [assert_same_up_to_near_tie(g, w) for g, w in zip(got, want, strict=True)]
        assert sum(exact) >= NUM_REQUESTS * 3 // 4, f"{exact.count(False)} outputs flipped"
        loads = [
            metric(d.base_url, "vllm:fabric_loads_ok_total") - b
            for d, b in zip(xpyd.decode, loads_before, strict=True)
        ]
        sent = [
            metric(p.base_url, "vllm:fabric_chunks_sent_total") - b
            for p, b in zip(xpyd.prefill, sent_before, strict=True)
        ]
        if min(loads) > 0 and min(sent) > 0:
            return
        unspread.append((loads, sent))
    raise AssertionError(("not spread over both P and both D", unspread))


BURST_TRIES = 2
"""Bursts tried: seen once in a full run, every prefill of a burst went to
one prefiller while the proxy routed none to the other (a stall on the
shared machine: a store call to an engine got no answer meanwhile); each
burst starts once the proxy is ready, and a policy that never uses one
engine fails both."""


def healthy(proxy: Proxy, engine: str) -> bool:
    text = httpx.get(proxy.url("/metrics"), timeout=10).text
    match = re.search(
        rf'^fabric_proxy_engine_healthy\{{engine="{engine}"[^}}]*\}} (\d+)$', text, re.M
    )
    assert match, text
    return match.group(1) == "1"


def seconds_until_down(proxy: Proxy, engine: str, since: float, limit: float = 30) -> float:
    while healthy(proxy, engine):
        if time.monotonic() - since > limit:
            return float("inf")
        time.sleep(0.1)
    return time.monotonic() - since


def test_decoder_killed_requests_succeed_on_the_other(xpyd: XPyD) -> None:
    """Runs last in this module: it kills decoder 1."""
    requests = workload(seed=2)[:10]
    want = reference(xpyd.prefill[0], requests)
    xpyd.decode[1].process.stop(timeout=0)  # SIGTERM, then SIGKILL at once
    killed = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        down = pool.submit(seconds_until_down, xpyd.proxy, "d1", killed)
        got = []
        for path, payload in requests:  # issued right after the kill, one by one
            t0 = time.monotonic()
            got.append(complete(xpyd.proxy.url(path), payload))
            assert time.monotonic() - t0 < 120
        assert down.result() < MARKED_DOWN_WITHIN_S
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)  # one at a time: exact (up to one bf16 step)
