"""The PD flow through the proxy, checked on what P and D received and what the client got."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from fabric.testing.fake_engine import fake_tokens

from .conftest import StartEngine, StartProxy

PROMPT = "the quick brown fox"
COMPLETION = {"model": "fake", "prompt": PROMPT, "max_tokens": 5, "min_tokens": 2}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}


def assert_answered(response: httpx.Response, body: dict[str, object]) -> None:
    """A 200 with the fake engine's whole answer to ``body`` (streamed or not)."""
    assert response.status_code == 200, response.text
    if body.get("stream"):
        assert sse_events(response.text)[-1] == "[DONE]"
    else:
        assert response.json()["choices"][0]["text"] == expected_text(body)


def expected_text(body: dict[str, object]) -> str:
    """What the fake decoder answers for ``body``."""
    prompt = body.get("prompt", body.get("messages"))
    return "".join(fake_tokens(prompt, int(body["max_tokens"])))  # type: ignore[call-overload]


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE stream."""
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def test_completion_goes_through_prefill_then_decode(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill", kv_endpoint="tcp://127.0.0.1:7001"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    body = {**COMPLETION, "stream_options": {"include_usage": True}}

    response = client.post(f"{proxy.url}/v1/completions", json=body)

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected_text(body)
    [prefill], [decode] = p.seen, d.seen
    sent = prefill["body"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert "min_tokens" not in sent and "stream_options" not in sent
    assert sent["prompt"] == PROMPT
    params = sent["kv_transfer_params"]
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert re.fullmatch(r"[0-9a-f]{32}", params["transfer_id"])
    assert params["decode_kv_endpoint"] == proxy.state.pool.decoders[0].kv_endpoint
    assert decode["body"] == {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": params["transfer_id"],
            "num_tokens": 4,
            "prefill_kv_endpoint": "tcp://127.0.0.1:7001",
        },
    }
    assert prefill["request_id"] == decode["request_id"] == params["transfer_id"]
    assert proxy.state.counters.fallbacks == 0


def test_stream_is_relayed_as_the_decoder_sends_it(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}

    response = client.post(f"{proxy.url}/v1/completions", json=body)

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected_text(body)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert p.seen[0]["body"]["stream"] is False
    assert d.seen[0]["body"]["stream"] is True
    assert d.seen[0]["body"]["stream_options"] == {"include_usage": True}
    assert d.seen[0]["body"]["kv_transfer_params"]["do_remote_prefill"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_use_the_same_flow(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, stream: bool
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    body = {**CHAT, "stream": stream, "max_completion_tokens": 5}

    response = client.post(f"{proxy.url}/v1/chat/completions", json=body)

    assert response.status_code == 200
    if stream:
        chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    else:
        text = response.json()["choices"][0]["message"]["content"]
    assert text == expected_text(CHAT)
    assert p.seen[0]["path"] == "/v1/chat/completions"
    assert p.seen[0]["body"]["max_tokens"] == 1
    assert "max_completion_tokens" not in p.seen[0]["body"]
    assert d.seen[0]["body"]["max_completion_tokens"] == 5


def test_round_robin_pairs_each_prefill_with_the_decoder_it_names(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    ps = [start_engine("prefill", kv_endpoint=f"tcp://127.0.0.1:{7100 + i}") for i in range(2)]
    ds = [start_engine("decode") for _ in range(2)]
    proxy = start_proxy([p.url for p in ps], [d.url for d in ds])

    for i in range(4):
        response = client.post(
            f"{proxy.url}/v1/completions", json={**COMPLETION, "prompt": f"p{i}"}
        )
        assert response.status_code == 200

    assert [len(p.seen) for p in ps] == [2, 2]
    assert [len(d.seen) for d in ds] == [2, 2]
    endpoints = {e.url: e.kv_endpoint for e in proxy.state.pool.decoders}
    for d in ds:
        for seen in d.seen:
            transfer_id = seen["body"]["kv_transfer_params"]["transfer_id"]
            [prefill] = [s for p in ps for s in p.seen if s["request_id"] == transfer_id]
            assert prefill["body"]["kv_transfer_params"]["decode_kv_endpoint"] == endpoints[d.url]


def test_client_kv_transfer_params_are_not_forwarded(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill", kv_params=False), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])
    body = {**COMPLETION, "kv_transfer_params": {"do_remote_prefill": True}}

    assert client.post(f"{proxy.url}/v1/completions", json=body).status_code == 200

    assert "kv_transfer_params" not in d.seen[0]["body"]
    assert p.seen[0]["body"]["kv_transfer_params"]["do_remote_decode"] is True
