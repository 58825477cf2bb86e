"""Readiness: ``/health`` and ``wait_ready`` mean every engine answers and every
P->D pair moved KV (a canary through the PD path, proven by the decoder's
load counters; the fake engines count loads as a fabric decoder does)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import httpx
import pytest

from fabric.router.fake_engine import FakeEngineConfig

from .conftest import StartEngine, StartProxy
from .servers import FakeEngine, Proxy, ServerThread
from .test_pd_flow import COMPLETION


def wait_ready(proxy: Proxy, timeout_s: float) -> list[str]:
    return proxy.run(lambda state: state.wait_ready(timeout_s))


def poll(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_wait_ready_runs_one_canary_per_pair(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    prefillers = [start_engine("prefill"), start_engine("prefill")]
    decoders = [start_engine("decode"), start_engine("decode")]
    proxy = start_proxy([p.url for p in prefillers], [d.url for d in decoders])

    assert wait_ready(proxy, 30) == []

    assert [d.state.loads_ok for d in decoders] == [2, 2]
    assert [len(p.state.canaries) for p in prefillers] == [2, 2]
    canary = decoders[0].state.canaries[0]
    assert canary["request_id"].startswith("fabric-canary-") and canary["body"]["max_tokens"] == 1
    assert canary["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    state = proxy.state
    assert state.counters.canaries == 4 and state.counters.requests == 0
    assert all(e.outstanding == 0 for e in state.pool.engines)
    assert state.tables()["canaries"] == 0
    assert client.get(f"{proxy.url}/health").status_code == 200
    status = client.get(f"{proxy.url}/fabric/status").json()
    assert status["ready"] is True and {p["state"] for p in status["pairs"]} == {"ok"}
    assert "fabric_proxy_ready 1\n" in client.get(f"{proxy.url}/metrics").text


def test_a_failed_pair_is_reported_not_used_and_retried(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """P0's pushes fail: its pair with D is reported (``/health``, status,
    ``wait_ready``), requests go through P1 meanwhile, and once P0 is fixed
    a retry makes the proxy ready."""
    p0, p1 = start_engine("prefill", push_fails=True), start_engine("prefill")
    d = start_engine("decode")
    proxy = start_proxy([p0.url, p1.url], [d.url])

    missing = wait_ready(proxy, 1.0)

    assert len(missing) == 1
    assert missing[0].startswith("prefill-0 -> decode-0: canary failed: decode-0 could not load")
    health = client.get(f"{proxy.url}/health")
    assert health.status_code == 503 and health.json()["missing"] == missing
    pairs = {(p["prefill"], p["state"]) for p in health.json()["pairs"]}
    assert pairs == {("prefill-0", "failed"), ("prefill-1", "ok")}
    status = client.get(f"{proxy.url}/fabric/status").json()
    assert status["ready"] is False and status["missing"] == missing
    for _ in range(4):  # round robin would give P0 two of them
        assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200
    assert (len(p0.seen), len(p1.seen)) == (0, 4)
    assert proxy.state.counters.fallbacks == 0

    p0.state.config = dataclasses.replace(p0.config, push_fails=False)
    proxy.state.readiness.retry_s = 0.1
    poll(lambda: client.get(f"{proxy.url}/health").status_code == 200, "no retry made it ready")

    assert proxy.state.counters.canary_failures >= 1
    for _ in range(2):
        client.post(f"{proxy.url}/v1/completions", json=COMPLETION)
    assert len(p0.seen) == 1


@pytest.mark.parametrize(
    ("prefill", "decode", "reason"),
    [
        ({}, {"fabric_metrics": False}, "decode-0 exports no vllm:fabric_loads_ok_total"),
        ({}, {"load_fails": True}, "decode-0 could not load the KV prefill-0 pushed"),
        ({"kv_params": False}, {}, "prefill-0 returned no kv_transfer_params"),
        ({}, {"fail_status": 500}, "decode-0 answered HTTP 500"),
        ({"delay_s": 5.0}, {}, "ReadTimeout"),
    ],
    ids=["no-metrics", "load-fails", "no-params", "decoder-500", "prefill-timeout"],
)
def test_a_canary_fails_with_the_reason(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    prefill: dict[str, Any],
    decode: dict[str, Any],
    reason: str,
) -> None:
    p, d = start_engine("prefill", **prefill), start_engine("decode", **decode)
    proxy = start_proxy([p.url], [d.url], prefill_timeout_s=0.5)

    missing = wait_ready(proxy, 2.0)

    assert len(missing) == 1 and missing[0].startswith("prefill-0 -> decode-0: canary failed")
    assert reason in missing[0]
    assert all(e.outstanding == 0 for e in proxy.state.pool.engines)


def test_a_decoder_unreachable_at_start_keeps_the_proxy_unready_until_it_answers(
    start_engine: StartEngine, start_proxy: StartProxy, servers: list[ServerThread]
) -> None:
    """The proxy serves through the decoders that answer; the missing one is
    named until it answers, then its pair's canary runs and the proxy is ready."""
    p, d0 = start_engine("prefill"), start_engine("decode")
    late = FakeEngine(FakeEngineConfig(role="decode"))  # its port is bound, nobody accepts
    servers.append(late)
    proxy = start_proxy([p.url], [d0.url, late.url])

    missing = wait_ready(proxy, 1.0)

    assert len(missing) == 1 and missing[0].startswith("decode-1: down (/health: ConnectError")
    for _ in range(2):
        response = httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=10)
        assert response.status_code == 200
    assert len(d0.seen) == 2
    late.start()
    assert wait_ready(proxy, 30) == []
    assert late.state.loads_ok == 1 and len(late.state.canaries) == 1
    assert len(d0.state.canaries) == 1  # its pair was proven once


def test_a_draining_engine_is_not_needed_and_gets_no_canary(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d0, d1 = start_engine("prefill"), start_engine("decode"), start_engine("decode")
    proxy = start_proxy([p.url], [d0.url, d1.url])

    async def drain_then_wait(state: Any) -> list[str]:
        state.set_draining("decode-1", True)
        missing: list[str] = await state.wait_ready(30)
        return missing

    assert proxy.run(drain_then_wait) == []
    assert (d0.state.loads_ok, d1.state.loads_ok, len(d1.state.canaries)) == (1, 0, 0)


def test_an_engine_back_up_gets_its_canaries_again(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    assert wait_ready(proxy, 30) == []

    async def restart(state: Any) -> None:
        state.mark_down("decode-0", "restarting")
        state.mark_up("decode-0")

    proxy.run(restart)
    first = client.get(f"{proxy.url}/health").json()
    poll(lambda: client.get(f"{proxy.url}/health").status_code == 200, "not ready again")

    assert "prefill-0 -> decode-0: canary pending" in first["missing"]
    assert d.state.loads_ok == 2


def test_the_health_loop_retries_failed_canaries_in_the_background(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", load_fails=True)
    proxy = start_proxy([p.url], [d.url], health_interval_s=0.05)
    readiness = proxy.state.readiness
    readiness.retry_s = 0.1
    assert readiness.active is False  # nobody asked: no canary traffic
    time.sleep(0.3)
    assert d.state.canaries == type(d.state.canaries)()

    client.get(f"{proxy.url}/health")  # readiness is watched from now on
    poll(lambda: d.state.load_failures >= 2, "failed canary not retried")
    d.state.config = dataclasses.replace(d.config, load_fails=False)
    poll(lambda: readiness.ready, "not ready after the decoder was fixed")
