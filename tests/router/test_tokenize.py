"""Tokenizing a text prompt for cache-aware hints: one engine per request,
within the lookup bound, and a failure of any kind is a miss (the request is
served all the same)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fabric.config import parse_topology

from .conftest import StartEngine
from .servers import FakeEngine, Proxy, ServerThread
from .test_pd_flow import COMPLETION


def cache_aware(
    servers: list[ServerThread], prefill: FakeEngine, decode: FakeEngine, **proxy: Any
) -> Proxy:
    """A cache-aware proxy over two engines without a kv_port on P (no lookups there)."""
    data = {
        "prefill": [{"name": "p0", "url": prefill.url}],
        "decode": [{"name": "d0", "url": decode.url, "kv_port": 7003}],
        "proxy": {"port": None, "health_interval_s": 0, "policy": "cache_aware", **proxy},
    }
    server = Proxy(parse_topology(data, source="test")).start()
    servers.append(server)
    return server


def test_prompts_are_tokenized_for_the_hints(
    start_engine: StartEngine, servers: list[ServerThread], client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = cache_aware(servers, p, d)

    for _ in range(4):
        assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200

    assert p.state.tokenized + d.state.tokenized == 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_tokenize_answer_that_is_not_json_is_a_miss(
    start_engine: StartEngine, servers: list[ServerThread], client: httpx.Client, stream: bool
) -> None:
    """Before: the 200 answer's JSON decode error reached the client as a 500."""
    p = start_engine("prefill", tokenize_text="<html>busy</html>")
    d = start_engine("decode", tokenize_text="<html>busy</html>")
    proxy = cache_aware(servers, p, d)

    response = client.post(f"{proxy.url}/v1/completions", json={**COMPLETION, "stream": stream})

    assert response.status_code == 200, response.text
    assert p.state.tokenized + d.state.tokenized == 1
    assert len(d.seen) == 1


def test_each_request_asks_one_engine_to_tokenize(
    start_engine: StartEngine, servers: list[ServerThread], client: httpx.Client
) -> None:
    """Both engines fail /tokenize: each request asked one of them, in turn
    (before: every engine, one after another, on every request)."""
    p = start_engine("prefill", tokenize_status=500)
    d = start_engine("decode", tokenize_status=500)
    proxy = cache_aware(servers, p, d)

    for _ in range(4):
        assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200

    assert (p.state.tokenized, d.state.tokenized) == (2, 2)


def test_a_hanging_tokenize_is_bounded_by_the_lookup_bound(
    start_engine: StartEngine, servers: list[ServerThread]
) -> None:
    """/tokenize never answers: the request waits the lookup bound (200 ms)
    and is served. Before, each engine was waited on for health_timeout_s
    (120 s here): the client's 60 s timeout ran out first."""
    p = start_engine("prefill", tokenize_delay_s=300.0)
    d = start_engine("decode", tokenize_delay_s=300.0)
    proxy = cache_aware(servers, p, d, lookup_timeout_ms=200, health_timeout_s=120)

    response = httpx.post(f"{proxy.url}/v1/completions", json=COMPLETION, timeout=60)

    assert response.status_code == 200
    assert p.state.tokenized + d.state.tokenized == 1


def test_draining_and_down_engines_are_not_asked_to_tokenize(
    start_engine: StartEngine, servers: list[ServerThread], client: httpx.Client
) -> None:
    """The admin lookup (which may try several engines): the draining one
    is skipped (before: asked first, as it was healthy)."""
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = cache_aware(servers, p, d)

    async def drain(state: Any) -> None:
        state.set_draining("p0", True)

    proxy.run(drain)
    response = client.post(f"{proxy.url}/fabric/lookup", json={"prompt": "the quick brown fox"})

    assert response.status_code == 200, response.text
    assert (p.state.tokenized, d.state.tokenized) == (0, 1)

    async def down(state: Any) -> None:
        state.mark_down("d0", "restarting")

    proxy.run(down)
    response = client.post(f"{proxy.url}/fabric/lookup", json={"prompt": "the quick brown fox"})

    assert response.status_code == 503  # no engine left to tokenize it
    assert (p.state.tokenized, d.state.tokenized) == (0, 1)
