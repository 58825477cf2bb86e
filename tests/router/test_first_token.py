"""The first token from the prefiller (``proxy.first_token: prefiller``), with fake engines.

The fake decoder starts its stream at once and waits inside it for the
proxy's word (``stream_at_once``), as vLLM's server does; its
``first_token_delay_s`` stands for the step in which a decoder computes the
prompt's last token after the load.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from fabric.router.first_token import FirstToken, Mismatch, Splice, continuation, eligible
from fabric.router.requests import CHAT_COMPLETIONS, COMPLETIONS
from fabric.testing.fake_engine import fake_tokens

from .conftest import StartEngine, StartProxy
from .servers import FakeEngine, Proxy
from .test_early_handoff import decoder, early_proxy, wait_for
from .test_pd_flow import PROMPT, sse_events

GREEDY = {
    "model": "fake",
    "prompt": PROMPT,
    "max_tokens": 5,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def stack(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    first_token: str = "prefiller",
    p_options: dict[str, Any] | None = None,
    **d_options: Any,
) -> tuple[FakeEngine, FakeEngine, Proxy]:
    p = start_engine("prefill", delay_s=0.3, **(p_options or {}))
    d, kv_port = decoder(start_engine, stream_at_once=True, **d_options)
    proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)], first_token=first_token)
    return p, d, proxy


def chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in sse_events(text) if e != "[DONE]"]


def tokens_of(events: list[dict[str, Any]]) -> list[str]:
    return [c["text"] for e in events for c in e["choices"] if c["text"]]


def test_the_prefillers_token_reaches_the_client_before_the_decoder_has_one(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    """D takes 60 s for its first token; the client has P's at once (old code:
    nothing for 60 s) and leaves; nothing is left behind."""
    _, _, proxy = stack(start_engine, start_proxy, first_token_delay_s=60)
    got: list[str] = []
    with (
        httpx.Client(timeout=httpx.Timeout(20.0), trust_env=False) as client,
        client.stream("POST", f"{proxy.url}/v1/completions", json=GREEDY) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                got.append(line)
                break
    [first] = [json.loads(line[6:]) for line in got]
    assert first["choices"][0]["text"] == fake_tokens(PROMPT, 5)[0]
    assert first["choices"][0]["token_ids"] is None  # the client did not ask
    assert first["id"].startswith("cmpl-")
    assert proxy.state.counters.first_tokens_from_prefill == 1
    wait_for(lambda: proxy.state.tables()["streams"] == 0)
    assert proxy.state.tables()["early_transfers"] == 0
    assert all(e.outstanding == 0 for e in proxy.state.pool.engines)


@pytest.mark.parametrize("want_ids", [False, True])
def test_the_stream_is_the_decoders_with_its_first_token_from_the_prefiller(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, want_ids: bool
) -> None:
    p, d, proxy = stack(start_engine, start_proxy, first_token_delay_s=0.2)
    body = {**GREEDY, "return_token_ids": True} if want_ids else GREEDY

    response = client.post(f"{proxy.url}/v1/completions", json=body)

    assert response.status_code == 200, response.text
    assert sse_events(response.text)[-1] == "[DONE]"
    events = chunks(response.text)
    assert tokens_of(events) == fake_tokens(PROMPT, 5)  # each token once, in order
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert {e["created"] for e in events} == {events[0]["created"]}
    choices = [c for e in events for c in e["choices"]]
    ids = [t for c in choices for t in (c.get("token_ids") or [])]
    if want_ids:
        assert ids == [int(t[2:]) for t in fake_tokens(PROMPT, 5)]
        assert choices[0]["prompt_token_ids"] is not None
        assert [c for c in choices if c.get("prompt_token_ids")] == choices[:1]
    else:
        assert ids == [] and all(c["prompt_token_ids"] is None for c in choices)
    assert events[-1]["usage"]["completion_tokens"] == 5  # D's, its first token counted
    assert choices[-1]["finish_reason"] == "length"
    assert p.seen[0]["body"]["return_token_ids"] is True
    assert d.seen[0]["body"]["return_token_ids"] is True
    counters = proxy.state.counters
    assert (counters.first_tokens_from_prefill, counters.first_token_mismatches) == (1, 0)
    assert proxy.state.first_token_lags == 1
    metrics = client.get(f"{proxy.url}/metrics").text
    assert "fabric_proxy_first_token_lag_seconds_count 1" in metrics
    assert "fabric_proxy_first_tokens_from_prefill_total 1" in metrics


@pytest.mark.parametrize("want_ids", [False, True])
def test_a_decoder_whose_first_token_differs_answers_again_from_the_prefillers(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, want_ids: bool
) -> None:
    """P's token went out; D's stream follows another token: never relayed.
    D is asked again, from P's token on, and that answer is the rest."""
    _, d, proxy = stack(start_engine, start_proxy, first_token_differs=True)
    body = {**GREEDY, "min_tokens": 2, "seed": 5, "return_token_ids": want_ids}

    response = client.post(f"{proxy.url}/v1/completions", json=body)

    assert response.status_code == 200
    assert sse_events(response.text)[-1] == "[DONE]"
    events = chunks(response.text)
    first = fake_tokens(PROMPT, 5)[0]
    prompt_again = [0, 1, 2, 3, int(first[2:])]  # the fake's ids of PROMPT, and P's token
    rest = fake_tokens(prompt_again, 4)
    assert tokens_of(events) == [first, *rest]
    assert all("error" not in e for e in events)
    assert {(e["id"], e["created"], e["model"]) for e in events} == {
        (events[0]["id"], events[0]["created"], events[0]["model"])
    }
    choices = [c for e in events for c in e["choices"]]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    assert ids == ([int(t[2:]) for t in [first, *rest]] if want_ids else [])
    assert [bool(c.get("prompt_token_ids")) for c in choices] == [want_ids] + [False] * 4
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    # NOTE: D's second request: the prompt's ids and P's token, one token less, no KV params
    again = d.seen[1]
    assert again["request_id"] == d.seen[0]["request_id"] + "-p1"
    assert again["body"]["prompt"] == prompt_again
    assert (again["body"]["max_tokens"], again["body"]["min_tokens"]) == (4, 1)
    assert again["body"]["seed"] == 5 and "kv_transfer_params" not in again["body"]
    counters = proxy.state.counters
    assert (counters.first_token_mismatches, counters.first_token_continuations) == (1, 1)
    assert proxy.state.first_token_lags == 1  # NOTE: D's own first token came, if another
    wait_for(lambda: proxy.state.tables()["streams"] == 0)
    assert all(e.outstanding == 0 for e in proxy.state.pool.engines)


def test_a_request_without_max_tokens_keeps_vllms_default_budget_when_asked_again(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """vLLM's completions default to 16 tokens: P's one and D's 15."""
    _, d, proxy = stack(start_engine, start_proxy, first_token_differs=True)
    body = {k: v for k, v in GREEDY.items() if k != "max_tokens"}

    response = client.post(f"{proxy.url}/v1/completions", json=body)

    assert len(tokens_of(chunks(response.text))) == 16
    assert d.seen[1]["body"]["max_tokens"] == 15
    assert proxy.state.counters.first_token_continuations == 1


@pytest.mark.parametrize(
    "change",
    [
        {"frequency_penalty": 0.5},  # counts output tokens only
        {"presence_penalty": 0.5},
        {"bad_words": ["x"]},
        {"response_format": {"type": "json_object"}},  # the grammar would start again
        {"structured_outputs": {"regex": "a+"}},
        {"truncate_prompt_tokens": 3},  # the prompt would be cut again
        {"max_tokens": None},  # the server decides
        {"temperature": 0.7, "seed": 1},  # a restarted generator: not the seed's draws
        {"some_future_field": 1},
    ],
)
def test_a_request_whose_rest_would_mean_otherwise_is_not_asked_again(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, change: Any
) -> None:
    _, d, proxy = stack(start_engine, start_proxy, first_token_differs=True)

    response = client.post(f"{proxy.url}/v1/completions", json={**GREEDY, **change})

    events = sse_events(response.text)
    assert json.loads(events[0])["choices"][0]["text"] == fake_tokens(PROMPT, 5)[0]
    assert "first token" in json.loads(events[1])["error"]["message"]
    assert len(events) == 2 and len(d.seen) == 1
    counters = proxy.state.counters
    assert (counters.first_token_mismatches, counters.first_token_continuations) == (1, 0)


def test_a_decoder_that_refuses_to_answer_again_ends_the_stream_with_an_error(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    _, _, proxy = stack(start_engine, start_proxy, first_token_differs=True, plain_fail_status=503)

    response = client.post(f"{proxy.url}/v1/completions", json=GREEDY)

    assert response.status_code == 200
    events = sse_events(response.text)
    assert json.loads(events[0])["choices"][0]["text"] == fake_tokens(PROMPT, 5)[0]
    error = json.loads(events[1])["error"]
    assert error["code"] == 502 and "HTTP 503" in error["message"]
    assert len(events) == 2  # nothing of D's after it
    counters = proxy.state.counters
    assert (counters.first_token_mismatches, counters.first_token_continuations) == (1, 0)
    assert counters.decode_errors == 1
    wait_for(lambda: proxy.state.tables()["streams"] == 0)
    assert all(e.outstanding == 0 for e in proxy.state.pool.engines)


@pytest.mark.parametrize("differs", [False, True])
def test_the_sequential_flow_sends_the_prefillers_token_first_too(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, differs: bool
) -> None:
    """D gets its request after P answered: P's token is always in first."""
    p = start_engine("prefill", kv_endpoint="tcp://127.0.0.1:7001")
    d = start_engine("decode", first_token_differs=differs)
    proxy = start_proxy([p.url], [d.url], handoff="sequential", first_token="prefiller")

    response = client.post(f"{proxy.url}/v1/completions", json=GREEDY)

    assert response.status_code == 200, response.text
    tokens = tokens_of(chunks(response.text))
    first = fake_tokens(PROMPT, 5)[0]
    assert tokens[0] == first and len(tokens) == 5
    if not differs:
        assert tokens == fake_tokens(PROMPT, 5)
    assert p.seen[0]["body"]["return_token_ids"] is True
    assert d.seen[0]["body"]["kv_transfer_params"]["num_tokens"] == 4  # P's params
    counters = proxy.state.counters
    assert (counters.first_tokens_from_prefill, counters.early_handoffs) == (1, 0)
    assert (counters.first_token_mismatches, counters.first_token_continuations) == (
        int(differs),
        int(differs),
    )


def test_a_failed_prefill_leaves_the_decoders_own_first_token(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    _, d, proxy = stack(start_engine, start_proxy, p_options={"fail_status": 500})

    response = client.post(f"{proxy.url}/v1/completions", json=GREEDY)

    assert response.status_code == 200, response.text
    events = chunks(response.text)
    assert tokens_of(events) == fake_tokens(PROMPT, 5)
    # NOTE: D was asked for ids; the client was not given them
    assert all(c["token_ids"] is None for e in events for c in e["choices"])
    assert d.state.early[d.seen[0]["request_id"]].startswith("failed")
    assert proxy.state.counters.first_tokens_from_prefill == 0
    assert proxy.state.counters.first_tokens_from_decode == 1
    assert proxy.state.counters.fallbacks == 1


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 0.7},  # unseeded sampling: P's and D's draws differ
        {"temperature": None},  # the server's default (sampled)
        {"stop": ["x"]},
        {"logprobs": 2},
        {"logprobs": 0},  # NOTE: 0 asks for logprobs too
        {"logprobs": False},  # vLLM reads it as 0
        {"return_token_ids": "false"},
        {"echo": True},
        {"n": 2},
        {"max_tokens": 1},
        {"stream": False},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ],
)
def test_other_requests_keep_the_decoders_first_token(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, change: Any
) -> None:
    p, d, proxy = stack(start_engine, start_proxy)
    body = {k: v for k, v in {**GREEDY, **change}.items() if v is not None}

    response = client.post(f"{proxy.url}/v1/completions", json=body)

    assert response.status_code == 200, response.text
    # NOTE: not asked by the proxy (the client's own field goes on as it is)
    assert p.seen[0]["body"].get("return_token_ids") == body.get("return_token_ids")
    assert d.seen[0]["body"].get("return_token_ids") == body.get("return_token_ids")
    assert proxy.state.counters.first_tokens_from_prefill == 0


def test_a_prefiller_keeps_a_minimum_of_one_token_as_the_decoder_does(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """D masks EOS and stop tokens at its first step (``min_tokens``): so does P."""
    p, _, proxy = stack(start_engine, start_proxy)

    client.post(f"{proxy.url}/v1/completions", json={**GREEDY, "min_tokens": 3})
    client.post(f"{proxy.url}/v1/completions", json=GREEDY)

    assert p.seen[0]["body"]["min_tokens"] == 1 and p.seen[0]["body"]["max_tokens"] == 1
    assert "min_tokens" not in p.seen[1]["body"]
    assert proxy.state.counters.first_tokens_from_prefill == 2


def test_an_error_from_the_decoder_before_its_first_token_ends_the_race(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """D's error event came before P's answer: P's token never follows it."""
    _, _, proxy = stack(start_engine, start_proxy, stream_error="the load failed")

    response = client.post(f"{proxy.url}/v1/completions", json=GREEDY)

    events = sse_events(response.text)
    assert json.loads(events[0])["error"]["message"] == "the load failed"
    assert events[1:] == ["[DONE]"]
    counters = proxy.state.counters
    assert (counters.first_tokens_from_prefill, counters.first_tokens_from_decode) == (0, 0)


def test_the_default_keeps_the_decoders_first_token(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    _, d, proxy = stack(start_engine, start_proxy, first_token="decoder")

    response = client.post(f"{proxy.url}/v1/completions", json=GREEDY)

    assert tokens_of(chunks(response.text)) == fake_tokens(PROMPT, 5)
    assert "return_token_ids" not in d.seen[0]["body"]
    assert proxy.state.counters.first_tokens_from_prefill == 0


def test_eligibility() -> None:
    assert eligible(GREEDY, COMPLETIONS)
    assert eligible({**GREEDY, "temperature": 0.9, "seed": 7}, COMPLETIONS)
    assert eligible({**GREEDY, "prompt": [1, 2, 3]}, COMPLETIONS)
    assert eligible({**GREEDY, "prompt": ["one"]}, COMPLETIONS)
    assert eligible({**GREEDY, "echo": False, "logprobs": None, "return_token_ids": 1}, COMPLETIONS)
    assert not eligible({**GREEDY, "echo": 0}, COMPLETIONS)
    assert not eligible({**GREEDY, "prompt_logprobs": 0}, COMPLETIONS)
    assert not eligible({**GREEDY, "prompt": ["one", "two"]}, COMPLETIONS)
    assert not eligible({**GREEDY, "seed": True, "temperature": 1}, COMPLETIONS)
    assert not eligible({**GREEDY, "temperature": False}, COMPLETIONS)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    assert not eligible({**chat, "stream": True}, CHAT_COMPLETIONS)


def p_answer(**choice: Any) -> dict[str, Any]:
    base = {"index": 0, "text": " hi", "token_ids": [42], "finish_reason": "length"}
    base["prompt_token_ids"] = [1, 2]
    return {"id": "cmpl-x", "created": 5, "model": "m", "choices": [{**base, **choice}]}


def test_only_one_whole_token_that_does_not_end_the_request_goes_first() -> None:
    assert FirstToken.of(p_answer(), 0.0) is not None
    assert FirstToken.of(p_answer(finish_reason="stop"), 0.0) is None  # EOS / stop token
    assert FirstToken.of(p_answer(text=""), 0.0) is not None  # a special token's
    assert FirstToken.of(p_answer(text="a\ufffd"), 0.0) is None  # part of a character
    assert FirstToken.of(p_answer(token_ids=[1, 2]), 0.0) is None
    assert FirstToken.of(p_answer(token_ids=None), 0.0) is None
    assert FirstToken.of({"choices": []}, 0.0) is None
    assert FirstToken.of([], 0.0) is None


def d_event(
    ids: list[int], text: str, finish: str | None = None, prompt_ids: list[int] | None = None
) -> bytes:
    """An event as vLLM streams it (``prompt_ids`` in the first one only)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    choice |= {"stop_reason": None, "prompt_token_ids": prompt_ids, "token_ids": ids}
    chunk = {"id": "cmpl-y", "object": "text_completion", "created": 6, "model": "m"}
    return b"data: " + json.dumps({**chunk, "choices": [choice]}).encode() + b"\n\n"


def test_the_splice_takes_the_first_token_out_of_the_decoders_stream() -> None:
    first = FirstToken.of(p_answer(), 0.0)
    assert first is not None
    splice = Splice(want_ids=True)
    splice.sent_first(first)
    stream = d_event([42], " hi", prompt_ids=[1, 2]) + d_event([7, 8], " a b")
    stream += b"data: [DONE]\n\n"
    # NOTE: fed in pieces that split events anywhere
    out = [e for i in range(0, len(stream), 7) for e in splice.feed(stream[i : i + 7])]
    assert splice.rest() == b""
    assert out[-1] == b"data: [DONE]\n\n"
    [event] = [json.loads(e[6:]) for e in out[:-1]]
    assert (event["id"], event["created"]) == ("cmpl-x", 5)
    assert event["choices"][0]["token_ids"] == [7, 8]
    assert event["choices"][0]["text"] == " a b"
    assert event["choices"][0]["prompt_token_ids"] is None


@pytest.mark.parametrize("want_ids", [False, True])
def test_the_splice_keeps_the_rest_of_a_first_event_with_more_tokens(want_ids: bool) -> None:
    first = FirstToken.of(p_answer(), 0.0)
    assert first is not None
    splice = Splice(want_ids=want_ids)
    splice.sent_first(first)
    [out] = splice.feed(d_event([42, 9], " hi there", "length", [1, 2]))
    event = json.loads(out[6:])
    choice = event["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" there", "length")
    assert choice["token_ids"] == ([9] if want_ids else None)
    assert choice["prompt_token_ids"] is None  # NOTE: P's event carried them
    assert (event["id"], event["created"], event["model"]) == ("cmpl-x", 5, "m")


def test_the_splice_reads_an_event_in_many_small_chunks_once() -> None:
    """A first event with a long prompt's ids, in 1-byte chunks: each byte is
    searched once (the old buffer was split anew on every chunk)."""
    splice = Splice(want_ids=True)
    event = d_event([42], " hi", prompt_ids=list(range(3000)))
    out = [e for i in range(len(event)) for e in splice.feed(event[i : i + 1])]
    assert [json.loads(e[6:])["choices"][0]["prompt_token_ids"] for e in out] == [list(range(3000))]


@pytest.mark.parametrize(("ids", "text"), [([43], " hi"), ([42], " ho"), ([42], ""), ([], "x")])
def test_the_splice_refuses_a_different_first_token(ids: list[int], text: str) -> None:
    first = FirstToken.of(p_answer(), 0.0)
    assert first is not None
    splice = Splice(want_ids=True)
    splice.sent_first(first)
    with pytest.raises(Mismatch):
        splice.feed(d_event(ids, text))


def test_a_one_token_answer_of_another_token_ends_with_the_prefillers() -> None:
    """D's budget was one token (its first event ends for length): P's token
    is the answer, D's finish goes on without its token."""
    first = FirstToken.of(p_answer(), 0.0)
    assert first is not None
    splice = Splice(want_ids=True)
    splice.sent_first(first)
    [out] = splice.feed(d_event([43], " ho", "length", [1, 2]))
    choice = json.loads(out[6:])["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("", [], "length")
    assert splice.ended_on_other


def test_a_first_token_with_an_empty_text_is_not_continued_after() -> None:
    """It may be part of a character: D's detokenizer, primed with a prompt
    ending in one, would emit the whole prompt's text."""
    body = {"model": "m", "prompt": "x", "max_tokens": 4, "temperature": 0}
    first = FirstToken.of(p_answer(), 0.0)
    empty = FirstToken.of(p_answer(text=""), 0.0)
    assert first is not None and empty is not None
    assert continuation(body, first) == {
        "model": "m",
        "prompt": [1, 2, 42],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    assert continuation(body, empty) is None


def test_the_decoders_first_token_first_goes_on_as_it_is() -> None:
    """D's token came before P's answer (or P's is unusable): nothing taken out."""
    splice = Splice(want_ids=False)
    error = b'data: {"error": {"message": "x"}}\n\n'
    out = splice.feed(d_event([42], " hi", prompt_ids=[1, 2]) + error)
    assert splice.joined
    choice = json.loads(out[0][6:])["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == (" hi", None, None)
    assert json.loads(out[0][6:])["id"] == "cmpl-y"
    assert out[1] == error


def test_two_streams_at_once_each_get_their_own_first_tokens(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """Two streams at once, each with its own race: each gets its own tokens."""
    _, _, proxy = stack(start_engine, start_proxy, first_token_delay_s=0.3)
    answers: dict[str, httpx.Response] = {}

    def ask(prompt: str) -> None:
        answers[prompt] = client.post(
            f"{proxy.url}/v1/completions", json={**GREEDY, "prompt": prompt}
        )

    threads = [threading.Thread(target=ask, args=(p,)) for p in ("alpha beta", "gamma delta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for prompt, response in answers.items():
        assert tokens_of(chunks(response.text)) == fake_tokens(prompt, 5)
    assert proxy.state.counters.first_tokens_from_prefill == 2
