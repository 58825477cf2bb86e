"""Request bounds of the proxy's own: body size (``proxy.max_body_bytes``), methods."""

from __future__ import annotations

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
