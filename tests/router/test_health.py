"""``/health`` (readiness), ``/v1/models``, ``/metrics`` and the background health loop."""

from __future__ import annotations

import time

import httpx

from .conftest import StartEngine, StartProxy
from .servers import Proxy, ServerThread, dead_url, topology


def test_health_is_503_naming_an_engine_that_does_not_answer(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url, dead_url()], [d.url])

    response = client.get(f"{proxy.url}/health")

    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable" and body["ready"] is False
    assert body["prefill"]["prefill-0"]["healthy"] is True
    assert body["prefill"]["prefill-1"]["healthy"] is False
    assert body["prefill"]["prefill-1"]["state"] == "down"
    assert "ConnectError" in body["prefill"]["prefill-1"]["error"]
    assert any(m.startswith("prefill-1: down (/health: ConnectError") for m in body["missing"])


def test_health_is_200_once_every_engine_answers_and_every_pair_passed_its_canary(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])

    first = client.get(f"{proxy.url}/health")
    deadline = time.monotonic() + 30
    while (answer := client.get(f"{proxy.url}/health")).status_code != 200:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.05)

    assert first.status_code == 503
    assert "prefill-0 -> decode-0: canary pending" in first.json()["missing"]
    body = answer.json()
    assert (body["status"], body["ready"], body["missing"]) == ("ok", True, [])
    assert body["pairs"][0]["state"] == "ok"
    assert d.state.loads_ok == 1 and len(d.state.canaries) == 1 and len(p.state.canaries) == 1
    assert p.seen == [] and d.seen == []  # canaries are not client requests
    assert proxy.state.counters.requests == 0 and proxy.state.counters.canaries == 1


def test_health_is_503_without_a_prefiller(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    d = start_engine("decode")
    proxy = start_proxy([dead_url()], [d.url])

    response = client.get(f"{proxy.url}/health")

    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"
    assert response.json()["decode"]["decode-0"]["healthy"] is True
    assert response.json()["prefill"]["prefill-0"]["state"] == "down"


def test_health_is_503_without_a_decoder(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p = start_engine("prefill")
    proxy = start_proxy([p.url], [dead_url()])

    assert client.get(f"{proxy.url}/health").status_code == 503


def test_models_come_from_the_first_healthy_decoder(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", model="tiny")
    proxy = start_proxy([p.url], [dead_url(), d.url])

    response = client.get(f"{proxy.url}/v1/models")

    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["tiny"]


def test_models_without_a_decoder_is_a_503_json_error(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p = start_engine("prefill")
    proxy = start_proxy([p.url], [dead_url()])

    response = client.get(f"{proxy.url}/v1/models")

    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable"


def test_health_loop_brings_a_prefiller_back(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url], health_interval_s=0.05)
    engine = proxy.state.pool.prefillers[0]
    engine.mark_down("test")

    deadline = time.monotonic() + 5.0
    while not engine.healthy and time.monotonic() < deadline:
        time.sleep(0.02)

    assert engine.healthy
    response = client.post(
        f"{proxy.url}/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2}
    )
    assert response.status_code == 200
    assert len(p.seen) == 1 and proxy.state.counters.fallbacks == 0


def test_metrics_export_counters_and_engine_gauges(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    client.post(f"{proxy.url}/v1/completions", json={"model": "fake", "prompt": "x"})

    text = client.get(f"{proxy.url}/metrics").text

    assert "fabric_proxy_requests_total 1\n" in text
    assert "fabric_proxy_fallbacks_total 0\n" in text
    assert 'fabric_proxy_engine_healthy{engine="decode-0",role="decode"} 1\n' in text
    assert 'fabric_proxy_engine_outstanding{engine="prefill-0",role="prefill"} 0\n' in text


def test_a_decoder_whose_fabric_thread_is_down_is_marked_down(
    start_engine: StartEngine, servers: list[ServerThread], client: httpx.Client
) -> None:
    from fabric.integrations.vllm.config import ConnectorConfig
    from fabric.integrations.vllm.worker import FabricWorker
    from tests.integrations.test_vllm_worker import BS, CT, caches

    p, d = start_engine("prefill"), start_engine("decode")
    config, kv_ports = topology([p.url], [d.url])
    proxy = Proxy(config).start()
    servers.append(proxy)
    extra = {"transport": "loopback", "chunk_tokens": CT, "store_mib": 4, "kv_port": kv_ports[0]}
    worker = FabricWorker(
        ConnectorConfig.from_extra(extra), produce=False, consume=True, block_size=BS, model="m"
    )
    worker.register_kv_caches(caches(3))
    try:
        assert client.get(f"{proxy.url}/health").json()["decode"]["decode-0"]["healthy"] is True
        assert worker.loader is not None
        worker.loader.close()  # the load thread is gone: no KV can load here
        body = client.get(f"{proxy.url}/health").json()["decode"]["decode-0"]
        assert body["healthy"] is False and "thread(s) down" in body["error"]
    finally:
        worker.shutdown()


def test_models_carry_the_client_credentials(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """A decoder started with --api-key: the client's key reaches it, and
    without one the client gets the engine's 401 (before: no key was sent,
    so every client got a 503)."""
    d = start_engine("decode", api_key="k")
    proxy = start_proxy([start_engine("prefill").url], [d.url])

    allowed = client.get(f"{proxy.url}/v1/models", headers={"Authorization": "Bearer k"})
    refused = client.get(f"{proxy.url}/v1/models")

    assert allowed.status_code == 200 and allowed.json()["data"][0]["id"] == "fake"
    assert refused.status_code == 401
