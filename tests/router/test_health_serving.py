"""``GET /health?serving=1``: whether this proxy can serve requests now (a
cluster's readiness probe), unlike ``/health`` (every engine and pair ready)."""

from __future__ import annotations

import httpx

from fabric.router.state import ProxyState

from .conftest import StartEngine, StartProxy
from .servers import dead_url

COMPLETION = {"model": "fake", "prompt": "hello there", "max_tokens": 4}


def test_serving_without_a_prefiller_the_decoder_computes_the_prompt(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    d = start_engine("decode")
    proxy = start_proxy([dead_url()], [d.url])

    plain = client.get(f"{proxy.url}/health")
    serving = client.get(f"{proxy.url}/health", params={"serving": "1"})

    assert plain.status_code == 503 and "serving" not in plain.json()  # unchanged
    assert serving.status_code == 200
    body = serving.json()
    assert (body["status"], body["serving"], body["ready"]) == ("ok", True, False)
    assert body["prefill"]["prefill-0"]["state"] == "down"
    assert any(m.startswith("prefill-0: down") for m in body["missing"])
    # what it promises: a request succeeds (the decoder computes the prompt)
    assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200


def test_serving_with_one_decoder_down(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [dead_url(), d.url])

    assert client.get(f"{proxy.url}/health").status_code == 503
    serving = client.get(f"{proxy.url}/health?serving=1")

    assert serving.status_code == 200 and serving.json()["serving"] is True
    assert serving.json()["decode"]["decode-0"]["state"] == "down"


def test_not_serving_without_a_healthy_decoder(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p = start_engine("prefill")
    proxy = start_proxy([p.url], [dead_url()])

    serving = client.get(f"{proxy.url}/health?serving=1")

    assert serving.status_code == 503
    body = serving.json()
    assert (body["status"], body["serving"], body["ready"]) == ("unavailable", False, False)
    assert body["decode"]["decode-0"]["state"] == "down"


def test_not_serving_when_every_decoder_drains(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    assert client.get(f"{proxy.url}/health?serving=1").status_code == 200

    async def drain(state: ProxyState) -> None:
        state.set_draining("decode-0", True)

    proxy.run(drain)
    serving = client.get(f"{proxy.url}/health?serving=1")

    assert serving.status_code == 503 and serving.json()["serving"] is False
    assert serving.json()["decode"]["decode-0"]["state"] == "draining"


def test_serving_other_values_are_the_plain_health(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    d = start_engine("decode")
    proxy = start_proxy([dead_url()], [d.url])

    for query in ("serving=0", "serving=", "other=1"):
        answer = client.get(f"{proxy.url}/health?{query}")
        assert answer.status_code == 503 and "serving" not in answer.json(), query
