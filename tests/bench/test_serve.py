"""``fabric bench serve`` against fabric's fake engine on a loopback port."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from fabric.bench import serve_cli
from fabric.bench.serve import ServeConfig, run_serve_bench
from fabric.bench.serve_workload import (
    HttpTokenCounter,
    LengthSpec,
    WorkloadConfig,
    arrival_times,
    build_prompts,
)
from fabric.errors import ConfigError
from fabric.launch.process import free_port
from fabric.testing.fake_engine import FakeEngineConfig, create_fake_engine


@contextmanager
def fake_engine(**kwargs: Any) -> Iterator[str]:
    """A fake engine serving model "tiny" in a thread on a free loopback port; its URL."""
    app = create_fake_engine(FakeEngineConfig(model="tiny", **kwargs))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake engine did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def seen(url: str) -> list[dict[str, Any]]:
    """Bodies of the generation requests the fake engine received."""
    return [r["body"] for r in httpx.get(f"{url}/fake/requests").json()]


def bench(url: str, **kwargs: Any) -> dict[str, Any]:
    workload = WorkloadConfig(**kwargs.pop("workload", {}))
    config = ServeConfig(url=url, model="tiny", workload=workload, **kwargs)
    return run_serve_bench(config, build_prompts(workload))


def test_streamed_completions_report_ttft_itl_and_tokens() -> None:
    with fake_engine() as url:
        report = bench(
            url,
            max_tokens=8,
            concurrency=4,
            workload={"num_requests": 12, "input_tokens": LengthSpec(20, 40), "shared_prefix": 0.5},
        )
        bodies = seen(url)
    assert report["completed"] == 12 and report["errors"] == {"count": 0, "first": []}
    assert report["output_tokens"] == 12 * 8  # from the usage the stream ends with
    assert report["ttft_ms"]["n"] == 12 and report["itl_ms"]["n"] == 12 * 7
    assert report["e2e_ms"]["n"] == 12
    for stats in (report["ttft_ms"], report["itl_ms"], report["e2e_ms"]):
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"]
    assert report["requests_per_s"] > 0 and report["output_tokens_per_s"] > 0
    words = [b["prompt"].split() for b in bodies]
    assert all(20 <= len(w) <= 40 for w in words)
    shortest = min(len(w) for w in words)
    assert len({tuple(w[: round(0.5 * shortest)]) for w in words}) == 1  # the shared prefix
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)


def test_inter_token_latency_follows_the_engine() -> None:
    with fake_engine(token_delay_s=0.02) as url:
        report = bench(url, max_tokens=5, workload={"num_requests": 3})
    assert report["itl_ms"]["p50"] >= 15
    assert report["e2e_ms"]["p50"] >= report["ttft_ms"]["p50"] + 4 * 15


def test_chat_without_streaming_measures_end_to_end_only() -> None:
    with fake_engine() as url:
        report = bench(
            url,
            endpoint="/v1/chat/completions",
            stream=False,
            max_tokens=4,
            workload={"num_requests": 5, "rate": 200.0},
        )
        bodies = seen(url)
    assert report["completed"] == 5 and report["output_tokens"] == 20
    assert report["ttft_ms"]["n"] == 0 and report["ttft_ms"]["p50"] is None
    assert report["e2e_ms"]["n"] == 5
    assert all(b["messages"][0]["role"] == "user" and not b["stream"] for b in bodies)


def test_errors_are_counted_with_their_first_messages() -> None:
    with fake_engine(fail_status=503) as url:
        report = bench(url, concurrency=8, workload={"num_requests": 7})
    assert report["completed"] == 0 and report["errors"]["count"] == 7
    assert len(report["errors"]["first"]) == 5
    assert "HTTP 503" in report["errors"]["first"][0]
    assert report["requests_per_s"] == 0


def test_unreachable_server_is_an_error_not_a_crash() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    report = bench(url, timeout_s=5, workload={"num_requests": 2})
    assert report["errors"]["count"] == 2 and "ConnectError" in report["errors"]["first"][0]


def test_cli_writes_json_and_ends_with_a_json_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    with fake_engine() as url:
        argv = [
            "--url",
            url,
            "--num-requests",
            "6",
            "--rate",
            "100",
            "--input-tokens",
            "16:32",
            "--max-tokens",
            "4",
            "--json",
            str(out),
        ]
        assert serve_cli.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["errors"] == 0 and json.loads(last)["requests_per_s"] > 0
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["config"]["workload"]["input_tokens"] == "16:32"


# ---------------------------------------------------------------- workload
def test_length_spec_parses_fixed_and_ranges() -> None:
    assert LengthSpec.parse("256") == LengthSpec(256, 256)
    assert LengthSpec.parse("128:512") == LengthSpec(128, 512)
    for bad in ("0", "9:3", "a", "1:2:3"):
        with pytest.raises(ConfigError):
            LengthSpec.parse(bad)


def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = arrival_times(WorkloadConfig(num_requests=2000, rate=50.0, seed=7))
    assert times[0] == 0 and times == sorted(times)
    assert 1 / 50 * 0.9 < times[-1] / 1999 < 1 / 50 * 1.1
    assert arrival_times(WorkloadConfig(num_requests=3)) == [0.0, 0.0, 0.0]


def test_prompts_are_fitted_with_a_tokenizer() -> None:
    def count(text: str) -> int:  # a tokenizer that splits every word in two
        return 2 * len(text.split())

    prompts = build_prompts(
        WorkloadConfig(num_requests=4, input_tokens=LengthSpec(100, 100)), count
    )
    assert all(p.counted and p.num_tokens == 100 for p in prompts)
    assert all(len(p.text.split()) == 50 for p in prompts)


def test_http_token_counter_calls_tokenize() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert request.url.path == "/tokenize" and body["model"] == "tiny"
        return httpx.Response(200, json={"count": len(body["prompt"].split()) + 1})

    counter = HttpTokenCounter("http://x", "tiny", transport=httpx.MockTransport(handler))
    try:
        assert counter("a b c") == 4
    finally:
        counter.close()


@pytest.mark.parametrize(
    "kwargs",
    [{"endpoint": "/v1/embeddings"}, {"max_tokens": 0}, {"concurrency": 0}, {"url": "localhost"}],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ServeConfig(**kwargs)


def test_event_lines_split_on_newlines_only() -> None:
    """A completion's text may hold U+2028 or U+0085 (str.splitlines would
    cut the JSON event there)."""
    import asyncio

    import httpx

    from fabric.bench.serve import sse_lines

    event = 'data: {"choices": [{"text": "a\u2028b\x85c"}]}'
    body = f"{event}\n\ndata: [DONE]\n\n".encode()

    async def lines() -> list[str]:
        return [line async for line in sse_lines(httpx.Response(200, content=body))]

    assert asyncio.run(lines()) == [event, "", "data: [DONE]", ""]
