"""Failures: prefill fallbacks, decoder errors within their bound, bad requests."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any, cast

import httpx
import pytest

from .conftest import StartEngine, StartProxy
from .servers import dead_url
from .test_pd_flow import COMPLETION, assert_answered, sse_events


def metric(client: httpx.Client, proxy_url: str, name: str) -> float:
    """One unlabelled sample of the proxy's ``/metrics``."""
    for line in client.get(f"{proxy_url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


PREFILL_FAILURES = [
    pytest.param(None, id="prefill-down"),
    pytest.param({"fail_status": 500}, id="prefill-500"),
    pytest.param({"kv_params": False}, id="no-kv-params"),
    pytest.param({"delay_s": 2.0}, id="prefill-timeout"),  # NOTE: tests bound P by 0.5 s
]
"""Fake prefillers that fail (None: unreachable), to parametrize ``prefill`` with."""


@pytest.mark.parametrize("prefill", PREFILL_FAILURES)
@pytest.mark.parametrize("stream", [False, True])
def test_failed_prefill_falls_back_to_the_decoder(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    client: httpx.Client,
    prefill: dict[str, Any] | None,
    stream: bool,
) -> None:
    p_url = dead_url() if prefill is None else start_engine("prefill", **prefill).url
    d = start_engine("decode")
    proxy = start_proxy([p_url], [d.url], prefill_timeout_s=0.5)
    body = {**COMPLETION, "stream": stream}

    started = time.monotonic()
    response = client.post(f"{proxy.url}/v1/completions", json=body)

    assert time.monotonic() - started < 3.0
    assert_answered(response, body)
    assert "kv_transfer_params" not in d.seen[0]["body"]
    assert d.seen[0]["body"]["max_tokens"] == 5
    assert metric(client, proxy.url, "fabric_proxy_fallbacks_total") == 1


def test_prefiller_that_refuses_connections_is_skipped_until_it_is_back(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    d = start_engine("decode")
    proxy = start_proxy([dead_url()], [d.url])

    for _ in range(3):
        assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200

    counters = proxy.state.counters
    assert (counters.fallbacks, counters.prefill_errors) == (3, 1)
    assert not proxy.state.pool.prefillers[0].healthy


@pytest.mark.parametrize("stream", [False, True])
def test_decoder_down_is_a_502_json_error(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, stream: bool
) -> None:
    p = start_engine("prefill")
    proxy = start_proxy([p.url], [dead_url()])

    response = client.post(f"{proxy.url}/v1/completions", json={**COMPLETION, "stream": stream})

    assert response.status_code == 502
    error = response.json()["error"]
    assert "decode-0" in error["message"] and "unreachable" in error["message"]
    assert (error["type"], error["code"]) == ("upstream_error", 502)
    assert proxy.state.counters.decode_errors == 1


@pytest.mark.parametrize("stream", [False, True])
def test_unreachable_decoder_sends_the_request_to_another(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, stream: bool
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    # round robin picks the dead decoder first
    proxy = start_proxy([p.url], [dead_url(), d.url], health_interval_s=0)

    response = client.post(f"{proxy.url}/v1/completions", json={**COMPLETION, "stream": stream})

    assert response.status_code == 200
    received = d.seen[-1]
    assert "kv_transfer_params" not in received["body"]  # its KV went to the dead one
    counters = proxy.state.counters
    assert (counters.decode_errors, counters.fallbacks) == (1, 1)


@pytest.mark.parametrize("stream", [False, True])
def test_slow_decoder_is_a_504_within_the_timeout(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, stream: bool
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", delay_s=2.0)
    proxy = start_proxy([p.url], [d.url], decode_timeout_s=0.5)

    started = time.monotonic()
    response = client.post(f"{proxy.url}/v1/completions", json={**COMPLETION, "stream": stream})

    assert time.monotonic() - started < 3.0
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "upstream_timeout"


def test_decoder_stalling_mid_stream_ends_the_stream_with_an_error_event(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", token_delay_s=2.0)
    proxy = start_proxy([p.url], [d.url], decode_timeout_s=0.5)

    started = time.monotonic()
    response = client.post(f"{proxy.url}/v1/completions", json={**COMPLETION, "stream": True})

    assert time.monotonic() - started < 3.0
    assert response.status_code == 200
    events = sse_events(response.text)
    assert '"text"' in events[0]
    assert '"upstream_timeout"' in events[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_decoder_error_status_is_passed_through(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, stream: bool
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", fail_status=400)
    proxy = start_proxy([p.url], [d.url])

    response = client.post(f"{proxy.url}/v1/completions", json={**COMPLETION, "stream": stream})

    assert response.status_code == 400
    assert "failing on purpose" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "param"),
    [
        pytest.param(b"{not json", None, id="invalid-json"),
        pytest.param(b"[1, 2]", None, id="not-an-object"),
        pytest.param(b'{"prompt": "x"}', "model", id="no-model"),
        pytest.param(b'{"model": "fake"}', "prompt", id="no-prompt"),
        pytest.param(b'{"model": "fake", "prompt": 3}', "prompt", id="prompt-int"),
        pytest.param(b'{"model": "fake", "prompt": []}', "prompt", id="prompt-empty"),
        pytest.param(b'{"model": 1, "prompt": "x"}', "model", id="model-int"),
        pytest.param(b'{"model": "fake", "prompt": "x", "stream": "yes"}', "stream", id="stream"),
        pytest.param(b'{"model": "fake", "prompt": "x", "max_tokens": "3"}', "max_tokens", id="mt"),
        pytest.param(b'{"model": "fake", "prompt": "x", "max_tokens": 0}', "max_tokens", id="mt0"),
    ],
)
def test_bad_requests_are_400_without_touching_engines(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    client: httpx.Client,
    content: bytes,
    param: str | None,
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])

    response = client.post(f"{proxy.url}/v1/completions", content=content)

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", 400, param)
    assert error["message"]
    assert p.seen == [] and d.seen == []
    assert proxy.state.counters.client_errors == 1


def test_chat_without_messages_is_a_400(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])

    response = client.post(f"{proxy.url}/v1/chat/completions", json=COMPLETION)

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"


def test_client_leaving_mid_stream_releases_the_decoder(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", token_delay_s=0.1)
    proxy = start_proxy([p.url], [d.url])
    decoder = proxy.state.pool.decoders[0]
    body = {**COMPLETION, "stream": True, "max_tokens": 200}

    with (
        httpx.Client(timeout=10, trust_env=False) as client,
        client.stream("POST", f"{proxy.url}/v1/completions", json=body) as response,
    ):
        # NOTE: keep the iterator: dropping it makes httpx close the connection.
        chunks = cast(Generator[bytes, None, None], response.iter_raw())
        first = next(chunks)
        assert decoder.outstanding == 1
        chunks.close()

    deadline = time.monotonic() + 3.0
    while decoder.outstanding and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.startswith(b"data: ")
    assert decoder.outstanding == 0


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_during_the_prefill_cancels_p_and_never_reaches_d(
    start_engine: StartEngine, start_proxy: StartProxy, stream: bool
) -> None:
    p, d = start_engine("prefill", delay_s=2.0), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    body = {**COMPLETION, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=0.5)
    state = proxy.state
    deadline = time.monotonic() + 3.0
    while state.counters.client_disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert state.counters.client_disconnects == 1
    assert state.in_flight == 0
    assert all(e.outstanding == 0 for e in state.pool.engines)
    time.sleep(2.0)  # past P's delay: a flow that went on would now reach D
    assert d.seen == []
    assert httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=10).status_code == 200


def test_request_past_its_deadline_is_a_504_and_frees_everything(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d = start_engine("prefill", delay_s=3.0), start_engine("decode")
    proxy = start_proxy([p.url], [d.url], request_deadline_s=0.5)
    started = time.monotonic()
    response = httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=10)
    assert time.monotonic() - started < 2.5
    assert response.status_code == 504
    assert "deadline" in response.json()["error"]["message"]
    state = proxy.state
    assert state.counters.deadline_exceeded == 1
    assert state.in_flight == 0 and all(e.outstanding == 0 for e in state.pool.engines)


def test_stream_past_its_deadline_ends_with_an_error_event(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p, d = start_engine("prefill"), start_engine("decode", token_delay_s=0.1)
    proxy = start_proxy([p.url], [d.url], request_deadline_s=1.0)
    body = {**COMPLETION, "stream": True, "max_tokens": 100}
    started = time.monotonic()
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=20) as r:
        events = sse_events(b"".join(r.iter_raw()).decode())
    assert time.monotonic() - started < 5  # 100 tokens would take 10 s
    assert "deadline" in str(events[-1])
    deadline = time.monotonic() + 3
    while proxy.state.pool.decoders[0].outstanding and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy.state.pool.decoders[0].outstanding == 0
