"""Bounds of the proxy's own: request body size (``proxy.max_body_bytes``),
methods, engine answer size (``max_answer_bytes``), waits for a pooled connection."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest

from .conftest import StartEngine, StartProxy
from .test_pd_flow import COMPLETION, expected_text

LIMIT = 4096


def chunked(data: bytes, size: int = 1024) -> Iterator[bytes]:
    """``data`` as a body without a Content-Length (sent chunked)."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_body_over_the_limit_is_a_413_and_reaches_no_engine(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, framing: str
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url], max_body_bytes=LIMIT)
    big = httpx.Request("POST", "/", json={**COMPLETION, "prompt": "x" * LIMIT}).read()
    content = big if framing == "content-length" else chunked(big)

    response = client.post(
        f"{proxy.url}/v1/completions",
        content=content,
        headers={"content-type": "application/json", "x-request-id": "big-1"},
    )
    after = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)

    assert response.status_code == 413
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", 413)
    assert "max_body_bytes" in error["message"]
    assert response.headers["x-request-id"] == "big-1"
    assert after.json()["choices"][0]["text"] == expected_text(COMPLETION)
    assert len(p.seen) == 1 and len(d.seen) == 1
    assert proxy.state.counters.client_errors == 1


def test_body_at_the_limit_is_served(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    body = httpx.Request("POST", "/", json={**COMPLETION, "prompt": "y" * 100}).read()
    proxy = start_proxy([p.url], [d.url], max_body_bytes=len(body))

    response = client.post(
        f"{proxy.url}/v1/completions",
        content=chunked(body, 7),
        headers={"content-type": "application/json"},
    )

    assert response.status_code == 200
    assert d.seen[0]["body"]["prompt"] == "y" * 100


def test_generation_routes_accept_post_only(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])

    response = client.get(f"{proxy.url}/v1/chat/completions")

    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == 405
    assert p.seen == [] and d.seen == []


def test_a_decoder_answer_past_the_answer_limit_is_a_502_naming_it(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """A non-streamed answer is read whole, so it is bounded (streams are
    relayed as they come)."""
    p, d = start_engine("prefill"), start_engine("decode", pad_bytes=10_000)
    proxy = start_proxy([p.url], [d.url])
    proxy.state.max_answer_bytes = 4096

    response = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)

    assert response.status_code == 502
    error = response.json()["error"]
    assert "4096 bytes" in error["message"] and "max_answer_bytes" in error["message"]
    assert error["type"] == "upstream_error"
    state = proxy.state
    assert (state.counters.answers_too_large, state.counters.decode_errors) == (1, 1)
    assert state.tables()["pool_busy"] == 0  # its connection was closed
    proxy.state.max_answer_bytes = 1 << 20
    assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200


def test_a_prefill_answer_past_the_answer_limit_falls_back_to_the_decoder(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill", pad_bytes=10_000), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    proxy.state.max_answer_bytes = 4096

    response = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)

    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == expected_text(COMPLETION)
    assert "kv_transfer_params" not in d.seen[0]["body"]
    counters = proxy.state.counters
    assert (counters.answers_too_large, counters.fallbacks) == (1, 1)


def test_a_wait_for_a_pooled_connection_is_bounded_and_a_503(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    """One connection per engine, held by a slow decode: the next request
    waits for it at most the pool bound (``connect_timeout_s`` here), then
    gets a 503 JSON error; before, it waited until the first one ended."""
    p, d = start_engine("prefill"), start_engine("decode", delay_s=3.0)
    proxy = start_proxy([p.url], [d.url], max_connections=1, connect_timeout_s=0.5)
    url = f"{proxy.url}/v1/completions"

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, json=COMPLETION, timeout=30)
        deadline = time.monotonic() + 10
        while len(d.seen) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = httpx.post(url, json=COMPLETION, timeout=30)
        assert first.result().status_code == 200

    assert second.status_code == 503
    error = second.json()["error"]
    assert "no free connection" in error["message"] and "decode-0" in error["message"]
    assert error["type"] == "service_unavailable"
    assert proxy.state.counters.pool_timeouts == 1
    assert proxy.state.pool.decoders[0].healthy  # busy is not down


def test_a_decoder_without_a_free_connection_sends_the_request_to_another(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    """D0's only connection is held by a slow decode; the next request for
    D0 waits the pool bound, then goes to D1 (nothing reached D0), which
    computes the prompt. Before, that client got the 503 although D1 was free."""
    p = start_engine("prefill")
    d0, d1 = start_engine("decode", delay_s=3.0), start_engine("decode")
    proxy = start_proxy([p.url], [d0.url, d1.url], max_connections=1, connect_timeout_s=0.5)
    url = f"{proxy.url}/v1/completions"

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, json=COMPLETION, timeout=30)  # round robin: D0
        deadline = time.monotonic() + 10
        while len(d0.seen) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = httpx.post(url, json=COMPLETION, timeout=30)  # D1
        third = httpx.post(url, json=COMPLETION, timeout=30)  # D0: no free connection
        assert first.result().status_code == 200

    assert (second.status_code, third.status_code) == (200, 200), third.text
    assert len(d0.seen) == 1 and len(d1.seen) == 2
    assert "kv_transfer_params" not in d1.seen[1]["body"]  # its KV went to D0
    counters = proxy.state.counters
    assert (counters.pool_timeouts, counters.fallbacks) == (1, 1)
    d0_engine = proxy.state.pool.decoders[0]
    assert d0_engine.healthy and not d0_engine.draining  # busy is not down
