"""Early handoff through the proxy, with fake engines whose decoders serve a kv port.

The fake decoder (``serve_kv``) waits for the proxy's word on a request
admitted at dispatch as a fabric decoder's loader does (see
:mod:`fabric.testing.fake_kv`), so these tests see what D was told and when.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from fabric.launch.process import free_port
from fabric.router.handoff import RUNNING_TTL_MS

from .conftest import StartEngine, StartProxy
from .servers import FakeEngine, Proxy, dead_url
from .test_failures import PREFILL_FAILURES
from .test_pd_flow import COMPLETION, assert_answered


def decoder(start_engine: StartEngine, **options: Any) -> tuple[FakeEngine, int]:
    port = free_port()
    engine = start_engine("decode", kv_endpoint=f"tcp://127.0.0.1:{port}", serve_kv=True, **options)
    return engine, port


def early_proxy(
    start_proxy: StartProxy, p_urls: list[str], decoders: list[tuple[FakeEngine, int]], **kw: Any
) -> Proxy:
    return start_proxy(
        p_urls,
        [d.url for d, _ in decoders],
        kv_ports=[k for _, k in decoders],
        handoff="early",
        **kw,
    )


def on_loop(proxy: Proxy, read: Any) -> Any:
    """``read(state)`` on the proxy's event loop (its tables change there)."""

    async def call(state: Any) -> Any:
        return read(state)

    return proxy.run(call)


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_the_decoder_gets_its_request_at_dispatch_and_loads_when_p_is_done(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client, stream: bool
) -> None:
    p = start_engine("prefill", delay_s=5.0)
    d, kv_port = decoder(start_engine)
    proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)])
    body = {**COMPLETION, "stream": stream}
    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(client.post(f"{proxy.url}/v1/completions", json=body))
    )
    thread.start()
    try:
        wait_for(lambda: bool(d.seen))
        # NOTE: D has its request while P still computes (the prefill leg runs)
        assert on_loop(proxy, lambda state: state.handoff.waiting) == 1
        tid = d.seen[0]["request_id"]
        assert d.seen[0]["body"]["kv_transfer_params"] == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": tid,
        }
        assert p.seen[0]["body"]["kv_transfer_params"]["decode_kv_endpoint"] == (
            f"tcp://127.0.0.1:{kv_port}"
        )
    finally:
        thread.join(30)
    [response] = answers
    assert_answered(response, body)
    assert d.state.early == {tid: "done"}
    assert d.state.kv is not None and d.state.kv.said[0] == (tid, "running")
    counters = proxy.state.counters
    assert (counters.early_handoffs, counters.fallbacks, counters.early_refused) == (1, 0, 0)
    assert proxy.state.tables()["early_transfers"] == 0


def test_a_long_prefill_keeps_the_decoder_waiting_by_heartbeats(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """P takes longer than one word holds: only the proxy's repeated
    ``running`` keeps D's load from running out (old code: no word at all)."""
    p = start_engine("prefill", delay_s=2 * RUNNING_TTL_MS / 1000)
    d, kv_port = decoder(start_engine)
    proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)])

    response = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)

    assert response.status_code == 200, response.text
    assert list(d.state.early.values()) == ["done"]
    assert d.state.kv is not None
    words = [state for _, state in d.state.kv.said]
    assert words.count("running") >= 3 and words[-1] == "done"


@pytest.mark.parametrize("prefill", PREFILL_FAILURES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_prefill_is_told_to_the_decoder_at_once(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    client: httpx.Client,
    prefill: dict[str, Any] | None,
    stream: bool,
) -> None:
    p_url = dead_url() if prefill is None else start_engine("prefill", **prefill).url
    d, kv_port = decoder(start_engine)
    proxy = early_proxy(start_proxy, [p_url], [(d, kv_port)], prefill_timeout_s=0.5)
    body = {**COMPLETION, "stream": stream}

    response = client.post(f"{proxy.url}/v1/completions", json=body)

    assert_answered(response, body)
    [outcome] = d.state.early.values()
    assert outcome.startswith("failed: prefill on prefill-0: "), outcome
    assert d.state.load_failures == 1 and d.state.loads_ok == 0
    assert proxy.state.counters.fallbacks == 1
    assert proxy.state.tables()["early_transfers"] == 0


def test_a_client_gone_during_the_prefill_ends_both_legs(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    p = start_engine("prefill", delay_s=30.0)
    d, kv_port = decoder(start_engine)
    proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)])
    with httpx.Client(timeout=1.0, trust_env=False) as short, pytest.raises(httpx.ReadTimeout):
        short.post(f"{proxy.url}/v1/completions", json=COMPLETION)
    # NOTE: the decoder's wait ends with the word the leg's cancel sends
    wait_for(lambda: bool(d.state.early))
    [outcome] = d.state.early.values()
    assert outcome == "failed: prefill on prefill-0: the request ended before its prefill"
    wait_for(lambda: proxy.state.tables()["requests"] == 0)
    assert proxy.state.tables()["early_transfers"] == 0
    assert proxy.state.pool.prefillers[0].outstanding == 0
    assert proxy.state.counters.client_disconnects == 1


def test_a_decoder_holding_its_early_budget_gets_the_sequential_flow(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p = start_engine("prefill", delay_s=5.0)
    d, kv_port = decoder(start_engine)
    tokens = len(COMPLETION["prompt"].encode()) // 4  # the proxy's estimate
    proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)], early_max_tokens=tokens + 1)
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(client.post(f"{proxy.url}/v1/completions", json=COMPLETION))

    first = threading.Thread(target=post)
    first.start()
    wait_for(lambda: on_loop(proxy, lambda state: state.handoff.waiting) == 1)
    post()  # NOTE: while the first holds D's budget
    first.join(30)

    assert [r.status_code for r in answers] == [200, 200]
    params = sorted((s["body"]["kv_transfer_params"] for s in d.seen), key=len)
    assert "num_tokens" not in params[0]  # the early one
    assert params[1]["num_tokens"] > 0  # P's params: the sequential flow
    counters = proxy.state.counters
    assert (counters.early_handoffs, counters.early_refused) == (1, 1)
    assert proxy.state.pool.decoders[0].early_tokens == 0


def test_a_decoder_that_got_nothing_is_replaced_and_the_prefill_leg_cancelled(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p = start_engine("prefill", delay_s=30.0)
    d, kv_port = decoder(start_engine)
    dead = (dead_url(), free_port())
    proxy = start_proxy(
        [p.url],
        [dead[0], d.url],
        kv_ports=[dead[1], kv_port],
        handoff="early",
        policy="round_robin",
    )
    response = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)

    assert response.status_code == 200, response.text
    # NOTE: the dead decoder was picked first; the live one computed it itself
    assert "kv_transfer_params" not in d.seen[0]["body"]
    assert proxy.state.counters.fallbacks == 1
    wait_for(lambda: proxy.state.pool.prefillers[0].outstanding == 0, timeout=10)
    assert proxy.state.tables()["early_transfers"] == 0


def test_a_prefiller_marked_down_has_its_early_legs_cancelled(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """A stuck prefiller (alive, never answering) would hold D's blocks until
    its timeout; marked down (by the health probe), its legs end at once."""
    p = start_engine("prefill", delay_s=60.0)
    d, kv_port = decoder(start_engine)
    proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)])
    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(client.post(f"{proxy.url}/v1/completions", json=COMPLETION))
    )
    thread.start()
    wait_for(lambda: bool(d.seen))
    on_loop(proxy, lambda state: state.mark_down("prefill-0", "/health: stuck"))
    thread.join(30)

    [response] = answers
    assert response.status_code == 200, response.text
    assert list(d.state.early.values()) == [
        "failed: prefill on prefill-0: marked down: /health: stuck"
    ]
    assert on_loop(proxy, lambda state: state.pool.decoders[0].early_tokens) == 0
    assert on_loop(proxy, lambda state: state.tables()["early_transfers"]) == 0


def test_a_decoder_that_refuses_the_word_gets_the_sequential_flow(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    """An older fabric decoder refuses PrefillState: after the first request
    (which it recomputes) it gets the sequential flow."""
    p = start_engine("prefill")
    d, kv_port = decoder(start_engine, refuse_words=True)
    proxy = early_proxy(start_proxy, [p.url], [(d, kv_port)])

    first = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)
    second = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)

    assert (first.status_code, second.status_code) == (200, 200)
    assert "num_tokens" not in d.seen[0]["body"]["kv_transfer_params"]  # early
    assert d.seen[1]["body"]["kv_transfer_params"]["num_tokens"] > 0  # sequential
    counters = proxy.state.counter_values()
    assert (counters["early_handoffs"], counters["early_refused"]) == (1, 1)
    assert counters["prefill_words_failed"] >= 1
