"""``X-Request-Id`` end to end: client -> P and D (unique per request) -> response."""

from __future__ import annotations

import re

import httpx
import pytest

from .conftest import StartEngine, StartProxy
from .servers import dead_url
from .test_pd_flow import COMPLETION


@pytest.mark.parametrize("stream", [False, True])
def test_client_request_id_reaches_prefill_and_decode(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, stream: bool
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    body = {**COMPLETION, "stream": stream}
    headers = {"X-Request-Id": "client-42"}

    responses = [
        client.post(f"{proxy.url}/v1/completions", json=body, headers=headers) for _ in range(2)
    ]

    assert [r.headers["x-request-id"] for r in responses] == ["client-42", "client-42"]
    ids = [s["request_id"] for s in p.seen]
    assert all(re.fullmatch(r"client-42-[0-9a-f]{8}", i) for i in ids)
    assert ids[0] != ids[1]  # a reused client id still gives P and D unique ids
    assert [s["request_id"] for s in d.seen] == ids
    assert [s["body"]["kv_transfer_params"]["transfer_id"] for s in d.seen] == ids


def test_without_a_client_id_the_transfer_id_is_returned(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])

    response = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)

    assert response.headers["x-request-id"] == d.seen[0]["request_id"] == p.seen[0]["request_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])


def test_errors_carry_the_request_id(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p = start_engine("prefill")
    proxy = start_proxy([p.url], [dead_url()])
    headers = {"X-Request-Id": "abc"}

    bad = client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}, headers=headers)
    down = client.post(f"{proxy.url}/v1/completions", json=COMPLETION, headers=headers)

    assert (bad.status_code, down.status_code) == (400, 502)
    assert bad.headers["x-request-id"] == down.headers["x-request-id"] == "abc"
