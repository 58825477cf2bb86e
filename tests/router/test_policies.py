"""Per-role policies (round robin, least outstanding) and conditional disaggregation."""

from __future__ import annotations

import time

import httpx
import pytest

from fabric.config import ProxyConfig, parse_topology
from fabric.errors import ConfigError
from fabric.router.engines import Engine
from fabric.router.policy import LeastOutstanding, RoundRobin, Routing, make_policy
from fabric.router.requests import CHAT_COMPLETIONS, COMPLETIONS, estimate_prompt_tokens

from .conftest import StartEngine, StartProxy
from .test_pd_flow import COMPLETION, expected_text


def engines(*outstanding: int) -> list[Engine]:
    return [
        Engine(f"e{i}", "decode", f"http://e{i}", None, outstanding=n)
        for i, n in enumerate(outstanding)
    ]


def test_round_robin_takes_engines_in_turn() -> None:
    pool = engines(0, 0, 0)
    policy = RoundRobin()

    assert [policy.pick(pool, {}).name for _ in range(4)] == ["e0", "e1", "e2", "e0"]


def test_least_outstanding_picks_the_least_loaded_and_rotates_ties() -> None:
    policy = LeastOutstanding()
    loaded = engines(3, 1, 2)
    tied = engines(0, 0, 0)

    assert [policy.pick(loaded, {}).name for _ in range(3)] == ["e1", "e1", "e1"]
    assert [policy.pick(tied, {}).name for _ in range(3)] == ["e0", "e1", "e2"]


def test_role_policies_default_to_policy() -> None:
    both = Routing.from_config(ProxyConfig(policy="least_outstanding"))
    mixed = Routing.from_config(ProxyConfig(decode_policy="least_outstanding"))

    assert (both.prefill.name, both.decode.name) == ("least_outstanding", "least_outstanding")
    assert (mixed.prefill.name, mixed.decode.name) == ("round_robin", "least_outstanding")


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"proxy\.decode_policy: unknown policy 'random'"):
        make_policy("random", "proxy.decode_policy")


@pytest.mark.parametrize(
    ("body", "endpoint", "tokens"),
    [
        ({"prompt": list(range(7))}, COMPLETIONS, 7),
        ({"prompt": [[1, 2], [3]]}, COMPLETIONS, 3),
        ({"prompt": "x" * 40}, COMPLETIONS, 10),
        ({"prompt": ["x" * 8, "y" * 8]}, COMPLETIONS, 4),
        ({"prompt": "é" * 4}, COMPLETIONS, 2),
        ({"messages": [{"role": "user", "content": "x" * 16}]}, CHAT_COMPLETIONS, 4),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 8}]}]},
            CHAT_COMPLETIONS,
            2,
        ),
    ],
)
def test_prompt_tokens_are_estimated_cheaply(
    body: dict[str, object], endpoint: object, tokens: int
) -> None:
    assert estimate_prompt_tokens(body, endpoint) == tokens  # type: ignore[arg-type]


def test_least_outstanding_decoder_avoids_a_busy_one(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p = start_engine("prefill")
    busy, idle = start_engine("decode"), start_engine("decode")
    proxy = start_proxy([p.url], [busy.url, idle.url], decode_policy="least_outstanding")
    proxy.state.pool.decoders[0].outstanding = 5  # as if serving five long requests

    for _ in range(3):
        assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200

    assert (len(busy.seen), len(idle.seen)) == (0, 3)
    assert proxy.state.policy.prefill.name == "round_robin"


@pytest.mark.parametrize("stream", [False, True])
def test_short_prompts_go_straight_to_the_decoder(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    client: httpx.Client,
    stream: bool,
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url], disaggregate_min_prompt_tokens=8)
    short = {**COMPLETION, "prompt": list(range(7)), "stream": stream}
    long = {**COMPLETION, "prompt": list(range(8)), "stream": stream}

    first = client.post(f"{proxy.url}/v1/completions", json=short)
    second = client.post(f"{proxy.url}/v1/completions", json=long)

    assert (first.status_code, second.status_code) == (200, 200)
    if not stream:
        assert first.json()["choices"][0]["text"] == expected_text(short)
    assert len(p.seen) == 1 and p.seen[0]["body"]["prompt"] == list(range(8))
    assert "kv_transfer_params" not in d.seen[0]["body"]
    assert d.seen[1]["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    counters = proxy.state.counters
    assert (counters.local_decodes, counters.fallbacks) == (1, 0)
    deadline = time.monotonic() + 5.0  # a stream's bookkeeping ends just after its last byte
    while proxy.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.state.in_flight == 0


def test_proxy_keys_are_validated_in_the_topology() -> None:
    base = {"prefill": [{"url": "http://p:1"}], "decode": [{"url": "http://d:1", "kv_port": 2}]}
    ok = parse_topology({**base, "proxy": {"prefill_policy": "least_outstanding"}})

    assert ok.proxy.prefill_policy == "least_outstanding" and ok.proxy.decode_policy is None
    with pytest.raises(ConfigError, match=r"proxy\.disaggregate_min_prompt_tokens: Input"):
        parse_topology({**base, "proxy": {"disaggregate_min_prompt_tokens": -1}})
    with pytest.raises(ConfigError, match=r"proxy\.decode_policy: Input should be"):
        parse_topology({**base, "proxy": {"decode_policy": "random"}})


def test_routing_uses_the_best_ranked_pairs() -> None:
    """Rank 0 (checked) before 1 (pending); None (failed) never; a decoder
    with only pending pairs waits while another has a checked one, one with
    no usable pair at all still serves (it computes the prompt itself)."""
    p0, p1 = engines(0, 0)
    d_ok, d_pending, d_failed = (Engine(f"d{i}", "decode", f"http://d{i}", None) for i in range(3))
    ranks = {
        (p0, d_ok): 0,
        (p1, d_ok): 1,
        (p0, d_pending): 1,
        (p1, d_pending): 1,
        (p0, d_failed): None,
        (p1, d_failed): None,
    }
    routing = Routing(RoundRobin(), RoundRobin())

    picks = [
        routing.pick([p0, p1], [d_ok, d_pending, d_failed], {}, None, lambda p, d: ranks[p, d])
        for _ in range(4)
    ]

    assert [(p and p.name, d.name) for p, d in picks] == [
        ("e0", "d0"),
        (None, "d2"),
        ("e0", "d0"),
        (None, "d2"),
    ]
    # nothing checked: pending pairs serve, in turn
    pending = {key: 1 for key in ranks}
    picks = [
        routing.pick([p0, p1], [d_ok, d_pending], {}, None, lambda p, d: pending[p, d])
        for _ in range(2)
    ]
    assert sorted(d.name for _, d in picks) == ["d0", "d1"]
