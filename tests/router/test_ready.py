"""Readiness: ``/health`` and ``wait_ready`` mean every engine answers and every
P->D pair moved KV (a canary through the PD path, proven by the decoder's
load counters; the fake engines count loads as a fabric decoder does).

A canary that shows the transfer broken takes its pair out of routing; one
that cannot tell (credentials, no metrics, a timeout) leaves it routed,
reported unverified, and retried."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from fabric.config import EngineConfig, parse_topology
from fabric.router.engines import api_key
from fabric.router.ready import PairState
from fabric.testing.fake_engine import FakeEngineConfig

from .conftest import StartEngine, StartProxy
from .servers import FakeEngine, Proxy, ServerThread
from .test_pd_flow import COMPLETION

HANG_GUARD_S = 60.0


def wait_ready(proxy: Proxy, timeout_s: float) -> list[str]:
    return proxy.run(lambda state: state.wait_ready(timeout_s), timeout=timeout_s + 30)


def settle(proxy: Proxy) -> list[str]:
    """What is missing once no pair's canary is pending any more (however
    long the canaries take on a loaded machine; a hang guard only)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        missing = wait_ready(proxy, 0.5)
        if not any(line.endswith(": canary pending") for line in missing):
            return missing
        assert time.monotonic() < deadline, missing


def poll(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def pair_states(client: httpx.Client, proxy: Proxy, route: str = "/health") -> dict[str, str]:
    pairs = client.get(f"{proxy.url}{route}").json()["pairs"]
    return {f"{p['prefill']} -> {p['decode']}": p["state"] for p in pairs}


def restart(proxy: Proxy, name: str) -> None:
    """What the supervisor does when an engine comes back: a new epoch."""

    async def go(state: Any) -> None:
        state.mark_down(name, "restarting")
        state.mark_up(name)

    proxy.run(go)


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

    missing = settle(proxy)

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

    p0.state.config = p0.config.model_copy(update={"push_fails": False})
    proxy.state.readiness.retry_s = 0.1
    poll(lambda: client.get(f"{proxy.url}/health").status_code == 200, "no retry made it ready")

    assert proxy.state.counters.canary_failures >= 1
    for _ in range(2):
        client.post(f"{proxy.url}/v1/completions", json=COMPLETION)
    assert len(p0.seen) == 1


@pytest.mark.parametrize(
    ("prefill", "decode", "reason"),
    [
        ({}, {"load_fails": True}, "decode-0 could not load the KV prefill-0 pushed"),
        ({"kv_params": False}, {}, "prefill-0 returned no kv_transfer_params"),
        ({}, {"fail_status": 500}, "decode-0 answered HTTP 500"),
        ({"fail_status": 400}, {}, "prefill-0 answered HTTP 400"),
    ],
    ids=["load-fails", "no-params", "decoder-500", "prefill-400"],
)
def test_a_canary_fails_on_evidence_the_transfer_is_broken(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    prefill: dict[str, Any],
    decode: dict[str, Any],
    reason: str,
) -> None:
    p, d = start_engine("prefill", **prefill), start_engine("decode", **decode)
    proxy = start_proxy([p.url], [d.url])

    missing = settle(proxy)

    assert len(missing) == 1 and missing[0].startswith("prefill-0 -> decode-0: canary failed")
    assert reason in missing[0]
    assert proxy.state.readiness.pairs[0].state is PairState.FAILED
    assert all(e.outstanding == 0 for e in proxy.state.pool.engines)


@pytest.mark.parametrize(
    ("prefill", "decode", "reason"),
    [
        ({}, {"fabric_metrics": False}, "decode-0 exports no vllm:fabric_loads_ok_total"),
        ({}, {"count_loads": False}, "did not move within"),
        ({"delay_s": 5.0}, {}, "ReadTimeout"),
        ({"fail_status": 503}, {}, "prefill-0 answered HTTP 503"),
        ({}, {"fail_status": 429}, "decode-0 answered HTTP 429"),
        ({"api_key": "sekrit"}, {}, "prefill-0 answered HTTP 401 (started with --api-key?"),
        ({}, {"api_key": "sekrit"}, "decode-0: /v1/models answered HTTP 401"),
    ],
    ids=[
        "no-metrics",
        "metrics-lag",
        "prefill-timeout",
        "prefill-busy",
        "decoder-429",
        "prefill-api-key",
        "decoder-api-key",
    ],
)
def test_a_canary_that_cannot_tell_leaves_the_pair_unverified(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    prefill: dict[str, Any],
    decode: dict[str, Any],
    reason: str,
) -> None:
    """Not ready (readiness needs a verified canary), but nothing showed the
    transfer broken: the pair stays routable. Before, it was failed."""
    p, d = start_engine("prefill", **prefill), start_engine("decode", **decode)
    proxy = start_proxy([p.url], [d.url], prefill_timeout_s=0.5)

    missing = settle(proxy)

    assert len(missing) == 1, missing
    assert missing[0].startswith("prefill-0 -> decode-0: canary unverified (pair still used)")
    assert reason in missing[0]
    readiness = proxy.state.readiness
    assert readiness.pairs[0].state is PairState.UNVERIFIED
    assert readiness.rank(*proxy.state.pool.engines) is not None
    assert proxy.state.counters.canary_failures == 0
    assert all(e.outstanding == 0 for e in proxy.state.pool.engines)


def test_an_unverified_pair_serves_requests_is_reported_and_retried(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """A decoder with its stats off (no fabric counters): requests still go
    P -> D with P's KV (before: the pair was failed and D recomputed every
    prompt); ``/health`` stays 503 naming it; its canary is retried."""
    p, d = start_engine("prefill"), start_engine("decode", fabric_metrics=False)
    proxy = start_proxy([p.url], [d.url])
    settle(proxy)

    for _ in range(2):
        assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200

    assert len(p.seen) == 2 and all("kv_transfer_params" in r["body"] for r in d.seen)
    assert proxy.state.counters.fallbacks == 0
    health = client.get(f"{proxy.url}/health")
    assert health.status_code == 503 and health.json()["ready"] is False
    [pair] = health.json()["pairs"]
    assert pair["state"] == "unverified" and "exports no" in pair["error"]
    status = client.get(f"{proxy.url}/fabric/status").json()
    assert status["pairs"][0]["state"] == "unverified" and status["ready"] is False
    counters = proxy.state.counters
    tries = counters.canaries_unverified
    proxy.state.readiness.retry_s = 0.05
    poll(
        lambda: client.get(f"{proxy.url}/health") and counters.canaries_unverified > tries,
        "no retry",
    )
    d.state.config = d.config.model_copy(update={"fabric_metrics": True})
    poll(lambda: client.get(f"{proxy.url}/health").status_code == 200, "not verified once fixed")


def test_canaries_carry_the_api_key_the_topology_gives(
    start_engine: StartEngine, servers: list[ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine's key in its ``args`` (``--api-key``), the other's from
    ``VLLM_API_KEY``: every canary passes. Before, canaries sent no
    ``Authorization`` and every pair failed on the 401."""
    p, d = start_engine("prefill", api_key="p-key"), start_engine("decode", api_key="d-key")
    monkeypatch.setenv("VLLM_API_KEY", "d-key")
    data = {
        "prefill": [{"url": p.url, "args": ["--api-key", "p-key"]}],
        "decode": [{"url": d.url, "kv_port": 7002}],
        "proxy": {"port": None, "health_interval_s": 0},
    }
    proxy = Proxy(parse_topology(data, source="test")).start()
    servers.append(proxy)

    assert wait_ready(proxy, 30) == []

    assert d.state.loads_ok == 1
    assert [e.api_key for e in proxy.state.pool.engines] == ["p-key", "d-key"]


def test_pending_pairs_are_used_only_when_no_checked_pair_exists(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    """Right after P1 comes back, its pair is pending: requests go through
    P0, whose pair is ok (before: round robin gave P1 half of them). Once
    P1's canary passes it gets its share again."""
    p0, p1, d = start_engine("prefill"), start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p0.url, p1.url], [d.url])
    assert wait_ready(proxy, 30) == []
    restart(proxy, "prefill-1")  # nothing asks for readiness: its canary waits

    for _ in range(4):
        assert httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=20).is_success

    assert (len(p0.seen), len(p1.seen)) == (4, 0)
    assert wait_ready(proxy, 30) == []
    for _ in range(2):
        httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=20)
    assert len(p1.seen) == 1


def test_an_engine_a_probe_finds_back_gets_its_canaries_at_once(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """What ``fabric up``'s supervisor does for a restarted engine: it probes
    it each tick (``probe_engine``). Once the probe finds it back, its
    pairs' canaries start then, not at the next health round (60 s here):
    before, it was healthy but got no request until that round."""
    p0, p1, d = start_engine("prefill"), start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p0.url, p1.url], [d.url], health_interval_s=60.0)
    assert wait_ready(proxy, 30) == []
    engine = next(e for e in proxy.state.pool.engines if e.name == "prefill-1")
    proxy.run(lambda state: _mark_down(engine))

    assert proxy.run(lambda state: state.probe_engine(engine)) is True

    poll(lambda: pair_states(client, proxy, "/fabric/status")["prefill-1 -> decode-0"] == "ok",
         "the restarted engine's pair was never checked")  # fmt: skip
    for _ in range(4):
        assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200
    assert len(p1.seen) == 2


async def _mark_down(engine: Any) -> None:
    engine.mark_down("process exited")


def test_a_decoder_with_only_pending_pairs_waits_while_another_has_checked_ones(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d0, d1 = start_engine("prefill"), start_engine("decode"), start_engine("decode")
    proxy = start_proxy([p.url], [d0.url, d1.url])
    assert wait_ready(proxy, 30) == []
    restart(proxy, "decode-1")

    for _ in range(4):
        assert httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=20).is_success

    assert (len(d0.seen), len(d1.seen)) == (4, 0)
    assert proxy.state.counters.fallbacks == 0
    assert wait_ready(proxy, 30) == []
    for _ in range(2):
        httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=20)
    assert len(d1.seen) == 1


def test_pending_pairs_are_used_when_there_is_nothing_better(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    """Before any canary (or with every pair pending) the proxy routes as without them."""
    p0, p1, d = start_engine("prefill"), start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p0.url, p1.url], [d.url])

    for _ in range(4):
        assert httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=20).is_success

    assert (len(p0.seen), len(p1.seen)) == (2, 2)


def test_a_hanging_canary_holds_up_only_its_own_decoder(
    start_engine: StartEngine, start_proxy: StartProxy, servers: list[ServerThread]
) -> None:
    """D0's canary hangs (its decode never answers within the guard); D1,
    down at first, comes up: its canary runs and passes at once. Before,
    the canaries ran in passes, and D1's waited for D0's to time out."""
    p, d0 = start_engine("prefill"), start_engine("decode", delay_s=300.0)
    late = FakeEngine(FakeEngineConfig(role="decode"))  # its port is bound, nobody accepts
    servers.append(late)
    proxy = start_proxy([p.url], [d0.url, late.url], decode_timeout_s=600)
    client = httpx.Client(timeout=20, trust_env=False)
    client.get(f"{proxy.url}/health")
    poll(lambda: len(d0.state.canaries) == 1, "D0's canary never reached it")

    late.start()
    poll(
        lambda: pair_states(client, proxy)["prefill-0 -> decode-1"] == "ok",
        "D1's canary waited for D0's",
    )

    assert pair_states(client, proxy, "/fabric/status")["prefill-0 -> decode-0"] == "pending"
    assert proxy.state.readiness.in_flight == 1  # D0's is still running
    assert late.state.loads_ok == 1 and d0.state.loads_ok == 0
    client.close()


def test_a_decoder_unreachable_at_start_keeps_the_proxy_unready_until_it_answers(
    start_engine: StartEngine, start_proxy: StartProxy, servers: list[ServerThread]
) -> None:
    """The proxy serves through the decoders that answer; the missing one is
    named until it answers, then its pair's canary runs and the proxy is ready."""
    p, d0 = start_engine("prefill"), start_engine("decode")
    late = FakeEngine(FakeEngineConfig(role="decode"))  # its port is bound, nobody accepts
    servers.append(late)
    proxy = start_proxy([p.url], [d0.url, late.url])

    missing = settle(proxy)

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

    restart(proxy, "decode-0")
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
    d.state.config = d.config.model_copy(update={"load_fails": False})
    poll(lambda: readiness.ready, "not ready after the decoder was fixed")


def test_an_engines_api_key_comes_from_its_args_its_env_or_the_proxys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def key(**fields: Any) -> str | None:
        return api_key(EngineConfig(name="e", role="decode", url="http://127.0.0.1:1", **fields))

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert key() is None
    assert key(args=["--api-key", "a", "--api-key", "b"]) == "a"
    assert key(args=["--port", "1", "--api-key=c"]) == "c"
    assert key(env={"VLLM_API_KEY": "d"}) == "d"
    monkeypatch.setenv("VLLM_API_KEY", "e")
    assert key() == "e"
    assert (
        key(args=["--api-key", "a"], env={"VLLM_API_KEY": "d"}) == "a"
    )  # the CLI wins, as in vLLM
