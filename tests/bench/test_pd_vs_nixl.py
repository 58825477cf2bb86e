"""The pure parts of ``benchmarks/pd_vs_nixl.py`` and the NixlConnector proxy (no vLLM)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from fabric.bench import nixl_proxy
from fabric.router.fake_engine import FakeEngineConfig
from tests.router.servers import FakeEngine, ServerThread

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pd_vs_nixl.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, imported as a module."""
    spec = importlib.util.spec_from_file_location("pd_vs_nixl", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pd_vs_nixl"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- prompts and arithmetic


def test_prompts_have_exactly_the_length_and_are_fresh_per_request(bench: ModuleType) -> None:
    prompt = bench.prompt_ids(4096, "client", 0)

    assert len(prompt) == 4096
    assert all(bench.TOKEN_LOW <= t < bench.TOKEN_HIGH for t in prompt)
    assert prompt == bench.prompt_ids(4096, "client", 0)  # same in every setup
    assert prompt[:1024] != bench.prompt_ids(1024, "client", 0)
    assert prompt != bench.prompt_ids(4096, "client", 1)
    assert prompt != bench.prompt_ids(4096, "proxy", 0)


def test_itl_handoff_and_ratio_arithmetic(bench: ModuleType) -> None:
    assert bench.itl_s([1.0, 1.1, 1.3, 1.6]) == pytest.approx(0.2)
    assert bench.itl_s([1.0]) is None
    assert bench.handoff_s(0.5, 0.2) == pytest.approx(0.3)
    assert bench.handoff_s(0.5, None) is None
    assert bench.ratio(1.0, 4.0) == 0.25
    assert bench.ratio(1.0, 0.0) is None
    assert bench.ratio(1.0, -0.1) is None  # a negative handoff is noise, not a ratio
    assert bench.ratio(None, 1.0) is None
    assert bench.median([3.0, None, 1.0, 2.0]) == 2.0
    assert bench.median([None]) is None


def test_rounds_split_the_request_indices(bench: ModuleType) -> None:
    assert [list(bench.round_indices(5, 2, r)) for r in range(2)] == [[0, 1], [2, 3, 4]]
    assert [list(bench.round_indices(2, 1, 0))] == [[0, 1]]
    assert [list(bench.round_indices(1, 2, r)) for r in range(2)] == [[], [0]]


def test_other_cores_is_the_machines_busy_time_minus_the_setups_own(bench: ModuleType) -> None:
    start = bench.CpuMark(wall_s=10.0, busy_s=100.0, ours_s=40.0)

    # 2 s: the machine was busy 3.0 s, the setup 2.0 s of it -> others kept 0.5 cores busy
    assert bench.other_cores(start, bench.CpuMark(12.0, 103.0, 42.0)) == pytest.approx(0.5)
    assert bench.other_cores(start, bench.CpuMark(12.0, 101.0, 42.0)) == 0.0  # tick jitter
    assert bench.other_cores(start, start) == 0.0
    assert bench.machine_busy_s() > 0


METRICS_TEXT = """\
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.25
vllm:nixl_xfer_time_seconds_created{engine="0",model_name="tiny"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1024.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 1.0
vllm:fabric_load_failures_total{engine="0",model_name="tiny"} 0.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_metrics_are_parsed_summed_over_labels_and_diffed(bench: ModuleType) -> None:
    before = bench.parse_metrics(METRICS_TEXT)
    after_text = METRICS_TEXT.replace("} 0.25", "} 0.40").replace(
        'fabric_load_failures_total{engine="0",model_name="tiny"} 0.0',
        'fabric_load_failures_total{engine="0",model_name="tiny"} 1.0',
    )

    assert before == {
        "vllm:nixl_xfer_time_seconds_count": 2.0,
        "vllm:nixl_xfer_time_seconds_sum": 0.25,
        "vllm:prefix_cache_hits_total": 1025.0,
        "vllm:fabric_load_failures_total": 0.0,
    }
    deltas = bench.metric_deltas(before, bench.parse_metrics(after_text))
    assert deltas == pytest.approx(
        {"vllm:nixl_xfer_time_seconds_sum": 0.15, "vllm:fabric_load_failures_total": 1.0}
    )
    assert bench.is_fallback(deltas)
    assert not bench.is_fallback({"vllm:nixl_xfer_time_seconds_sum": 0.15})


def _sample(bench: ModuleType, setup: str, length: int, phase: str, **values: Any) -> Any:
    sample = bench.Sample(setup, phase, length, values.pop("index", 0))
    defaults = {"ttft_s": 1.0, "e2e_s": 2.0, "output_tokens": 32, "itl_s": 0.03}
    for name, value in {**defaults, **values}.items():
        setattr(sample, name, value)
    return sample


def _samples(bench: ModuleType) -> list[dict[str, Any]]:
    from dataclasses import asdict

    out = []
    for setup, handoffs, ttft in (("fabric", [0.1, 0.3, 0.2], 10.0), ("nixl", [0.4, 0.5], 8.0)):
        for i, handoff in enumerate(handoffs):
            out.append(
                _sample(bench, setup, 4096, "client", index=i, handoff_s=handoff, ttft_s=ttft)
            )
        out.append(_sample(bench, setup, 1024, "client", ttft_s=ttft / 10))
    out.append(_sample(bench, "nixl", 1024, "client", index=1, ttft_s=None, error="HTTP 500"))
    out.append(_sample(bench, "fabric", 4096, "warmup", handoff_s=9.0, ttft_s=99.0))
    return [asdict(s) for s in out]


def test_summary_rows_take_medians_of_good_samples_and_skip_warmups(bench: ModuleType) -> None:
    rows = bench.summarize(_samples(bench))

    fabric_4k = bench.find_row(rows, "fabric", 4096, "client")
    assert fabric_4k["n"] == 3 and fabric_4k["errors"] == 0
    assert fabric_4k["handoff_s"] == pytest.approx(0.2)
    assert fabric_4k["out_tok_per_s"] == pytest.approx(96 / 6.0)
    assert fabric_4k["req_per_s"] == pytest.approx(3 / 6.0)
    nixl_1k = bench.find_row(rows, "nixl", 1024, "client")
    assert nixl_1k["n"] == 2 and nixl_1k["errors"] == 1 and nixl_1k["ttft_s"] == 0.8
    assert bench.find_row(rows, "fabric", 4096, "warmup") == {}


def test_headline_is_fabric_over_nixl_at_4k_and_the_worst_ttft(bench: ModuleType) -> None:
    rows = bench.summarize(_samples(bench))

    assert bench.headline(rows, (1024, 4096)) == {
        "handoff_fabric_over_nixl_4k": pytest.approx(0.2 / 0.45, abs=1e-3),
        "ttft_fabric_over_nixl_max": 1.25,
    }
    assert bench.headline(rows, (1024,)) == {
        "handoff_fabric_over_nixl_4k": pytest.approx(0.444, abs=1e-3),
        "ttft_fabric_over_nixl_max": 1.25,
    }
    assert bench.headline([], (1024,)) == {
        "handoff_fabric_over_nixl_4k": None,
        "ttft_fabric_over_nixl_max": None,
    }


def test_token_ids_are_compared_with_the_colocated_engine(bench: ModuleType) -> None:
    samples = [
        {"setup": "colocated", "phase": "client", "length": 8, "index": 0, "token_ids": [1, 2]},
        {"setup": "colocated", "phase": "client", "length": 8, "index": 1, "token_ids": [3, 4]},
        {"setup": "fabric", "phase": "client", "length": 8, "index": 0, "token_ids": [1, 2]},
        {"setup": "fabric", "phase": "client", "length": 8, "index": 1, "token_ids": [3, 5]},
        {"setup": "nixl", "phase": "client", "length": 8, "index": 0, "token_ids": [1, 2]},
    ]

    assert bench.token_matches(samples) == {"fabric": "1/2", "nixl": "1/1"}


def test_stream_completion_times_each_token_and_reads_usage(bench: ModuleType) -> None:
    events = [
        {"choices": [{"index": 0, "text": "a", "token_ids": [7]}]},
        {"choices": [{"index": 0, "text": "bc", "token_ids": [8, 9]}]},
        {"choices": [], "usage": {"prompt_tokens": 1024, "completion_tokens": 3}},
    ]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=sse + b"data: [DONE]\n\n")

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        body = bench.generation_body([5, 6], 3)
        stream = bench.stream_completion(client, "http://engine/v1/completions", bench.dump(body))

    assert seen == [body]
    assert stream.error is None and stream.token_ids == [7, 8, 9] and stream.prompt_tokens == 1024
    assert len(stream.token_s) == 3 and stream.token_s[1] == stream.token_s[2]
    sample = bench.Sample("colocated", "client", 2, 0)
    bench.fill_from_stream(sample, stream, offset_s=1.0)
    assert sample.ttft_s == pytest.approx(1.0 + stream.token_s[0])
    assert sample.output_tokens == 3 and sample.e2e_s >= sample.ttft_s


def test_stream_completion_reports_an_engine_error(bench: ModuleType) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(500, text="boom"))
    with httpx.Client(transport=transport) as client:
        stream = bench.stream_completion(client, "http://engine/v1/completions", b"{}")

    assert stream.error == "HTTP 500: boom" and stream.token_s == []


# ---------------------------------------------------------------- the NixlConnector proxy


def test_prefill_and_decode_bodies_follow_the_nixl_flow() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 9, "stream": True, "min_tokens": 3,
            "stream_options": {"include_usage": True}}  # fmt: skip

    prefill = nixl_proxy.prefill_body(body)
    params = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e"}

    assert prefill == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert nixl_proxy.decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert body["max_tokens"] == 9  # the client's body is not changed


@pytest.fixture
def servers() -> Iterator[list[ServerThread]]:
    started: list[ServerThread] = []
    yield started
    for server in started:
        server.stop()


def _start(servers: list[ServerThread], server: ServerThread) -> Any:
    servers.append(server.start())
    return server


def _proxy(servers: list[ServerThread], p: FakeEngine, d: FakeEngine) -> ServerThread:
    config = nixl_proxy.NixlProxyConfig(p.url, d.url, timeout_s=10.0)
    return _start(servers, ServerThread(nixl_proxy.create_app(config)))


def test_proxy_sends_p_one_token_then_d_the_body_with_ps_params(
    servers: list[ServerThread],
) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill", kv_endpoint="tcp://x:1")))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d)
    body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}

    response = httpx.post(
        f"{proxy.url}/v1/completions", json=body, headers={"x-request-id": "r1"}, timeout=10
    )

    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["text"].split()) == 4
    [prefill], [decode] = p.seen, d.seen
    assert prefill["body"] == nixl_proxy.prefill_body(body)
    returned = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": None,
                "num_tokens": 3, "prefill_kv_endpoint": "tcp://x:1"}  # fmt: skip
    assert decode["body"] == {**body, "kv_transfer_params": returned}
    assert prefill["request_id"] == decode["request_id"] == "r1"


def test_proxy_relays_the_decoders_stream(servers: list[ServerThread]) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill")))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d)
    body = {"model": "fake", "prompt": [5, 6], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]

    assert len(events) == 3 + 1 + 1  # tokens, usage, [DONE]
    assert events[-1] == "data: [DONE]"
    [prefill], [decode] = p.seen, d.seen
    assert prefill["body"]["stream"] is False and "stream_options" not in prefill["body"]
    assert decode["body"]["stream"] is True and decode["body"]["stream_options"]


@pytest.mark.parametrize(
    "prefill_config",
    [{"fail_status": 500}, {"kv_params": False}],
    ids=["prefill-error", "no-kv-params"],
)
def test_a_failed_prefill_is_a_502_and_d_is_not_called(
    servers: list[ServerThread], prefill_config: dict[str, Any]
) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill", **prefill_config)))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d)

    response = httpx.post(
        f"{proxy.url}/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=10
    )

    assert response.status_code == 502
    assert response.json()["error"]["message"].startswith("prefill failed")
    assert d.seen == []


def test_proxy_health_names_each_engine(servers: list[ServerThread]) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill")))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d)

    assert httpx.get(f"{proxy.url}/health", timeout=10).json() == {
        "status": "ok",
        "prefill": 200,
        "decode": 200,
    }
    d.stop()
    assert httpx.get(f"{proxy.url}/health", timeout=10).status_code == 503


def test_proxy_config_refuses_bad_urls() -> None:
    with pytest.raises(ValueError, match="prefill_url"):
        nixl_proxy.NixlProxyConfig("localhost:1", "http://127.0.0.1:2")
