"""``X-Request-Id`` end to end: client -> P and D (unique per request) -> response."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest

from fabric.router import pd

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
    assert all(re.fullmatch(r"client-42-[0-9a-f]{16}", i) for i in ids)
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


class _Uuid:
    def __init__(self, hex: str) -> None:
        self.hex = hex


def test_transfer_ids_are_drawn_again_when_one_is_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    draws = iter(["a" * 32, "a" * 32, "b" * 32])
    monkeypatch.setattr(pd, "uuid4", lambda: _Uuid(next(draws)))

    first = pd.new_transfer_id("client", {})
    second = pd.new_transfer_id("client", {first: object()})

    assert (first, second) == ("client-" + "a" * 16, "client-" + "b" * 16)


def test_two_requests_in_flight_never_share_a_transfer_id(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The random suffix drawn twice the same while the first request is in
    flight: the second still gets an id of its own (before: both went to
    P and D as one request id, and the first to end dropped the other's
    entry from the requests table)."""
    draws = iter(["c" * 32, "c" * 32, "d" * 32])
    monkeypatch.setattr(pd, "uuid4", lambda: _Uuid(next(draws)))
    p, d = start_engine("prefill"), start_engine("decode", delay_s=3.0)
    proxy = start_proxy([p.url], [d.url])
    url = f"{proxy.url}/v1/completions"
    headers = {"X-Request-Id": "same"}

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, json=COMPLETION, headers=headers, timeout=30)
        deadline = time.monotonic() + 10
        while len(d.seen) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = httpx.post(url, json=COMPLETION, headers=headers, timeout=30)
        assert first.result().status_code == 200
    assert second.status_code == 200

    assert sorted(s["request_id"] for s in d.seen) == ["same-" + "c" * 16, "same-" + "d" * 16]
    assert proxy.state.requests == {}
