"""1P1D on real vLLM: the proxy pairs a prefiller and a decoder, fabric moves the KV.

Oracle: a third, colocated engine serving the same model. For every prompt
the decoder's tokens must equal the colocated engine's, and its logprobs
must be within a few bf16 steps (the decoder recomputes the last prompt
token with its decode kernel). The decoder's own metrics must show the
prompt came over the fabric, not from local compute.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabric.config import parse_topology
from fabric.launch.process import free_port
from tests.e2e._engines import Engine, EngineFactory

pytestmark = pytest.mark.e2e

CHUNK_TOKENS = 256  # vLLM CPU block size is 128: 2 blocks per chunk
# shorter than a chunk, exact multiples, partial last chunks, more than 4 chunks
PROMPT_LENGTHS = [3, 40, 127, 128, 255, 256, 257, 300, 384, 511, 512, 513, 700, 768]
PROMPT_LENGTHS += [1024, 1100, 1300, 1536, 1800, 2000]
MAX_TOKENS = 6
LOGPROB_ABS_TOL = 0.01  # one bf16 step; measured: 0.0003 on the tiny model
FALLBACK_BOUND_S = 60.0


def kv_config(role: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "FabricConnector",
        "kv_connector_module_path": "fabric.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "store_mib": 256, **extra},
    }


class Proxy:
    """The fabric proxy app served by uvicorn in a thread of the test process."""

    def __init__(self, prefill: Engine, decode: Engine, kv_port: int) -> None:
        import uvicorn

        from fabric.router.app import create_app

        topology = parse_topology(
            {
                "prefill": [{"name": "p0", "url": prefill.base_url}],
                "decode": [{"name": "d0", "url": decode.base_url, "kv_port": kv_port}],
                "proxy": {"port": None, "prefill_timeout_s": 120, "decode_timeout_s": 180},
            }
        )
        self.port = free_port()
        config = uvicorn.Config(
            create_app(topology), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.05)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


class Cluster:
    def __init__(self, engines: EngineFactory, model_dir: Path) -> None:
        self.kv_port = free_port()
        specs = {
            "colocated": {"cpu_cores": "0"},
            "prefill": {"cpu_cores": "0", "kv_transfer_config": kv_config("kv_producer")},
            "decode": {
                "cpu_cores": "1",
                "kv_transfer_config": kv_config("kv_consumer", kv_port=self.kv_port),
            },
        }
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(engines.start, model_dir, name=name, **kwargs)
                for name, kwargs in specs.items()
            }
            started = {name: f.result() for name, f in futures.items()}
        self.colocated, self.prefill, self.decode = (
            started["colocated"],
            started["prefill"],
            started["decode"],
        )
        self.proxy = Proxy(self.prefill, self.decode, self.kv_port)


@pytest.fixture(scope="module")
def cluster(engines: EngineFactory, tiny_model_dir: Path) -> Iterator[Cluster]:
    c = Cluster(engines, tiny_model_dir)
    yield c
    c.proxy.stop()


def prompt_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(length)]


def body(prompt: list[int], *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
        "stream": stream,
    }


def complete(url: str, payload: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of the generated tokens, streamed or not."""
    if not payload.get("stream"):
        response = httpx.post(url, json=payload, timeout=300)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])
    ids: list[int] = []
    lps: list[float] = []
    with httpx.stream("POST", url, json=payload, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                ids += choice.get("token_ids") or []
                lps += (choice.get("logprobs") or {}).get("token_logprobs") or []
    return ids, lps


def metric(engine_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    text = httpx.get(engine_url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def assert_same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS_TOL)


def test_pd_output_equals_colocated_and_kv_came_over_the_fabric(cluster: Cluster) -> None:
    d_url = cluster.decode.base_url
    before_ok = metric(d_url, "vllm:fabric_loads_ok_total")
    before_local = metric(d_url, "vllm:prompt_tokens_by_source_total", source="local_compute")
    before_ext = metric(d_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]
    max_diff = 0.0
    for i, prompt in enumerate(prompts):
        want = complete(cluster.colocated.url("/v1/completions"), body(prompt))
        got = complete(cluster.proxy.url("/v1/completions"), body(prompt, stream=i % 2 == 1))
        assert_same(got, want)
        max_diff = max(max_diff, *(abs(a - b) for a, b in zip(got[1], want[1], strict=True)))
    print(f"{len(prompts)} prompts equal to colocated; max |logprob diff| {max_diff:.4f}")
    assert metric(d_url, "vllm:fabric_loads_ok_total") - before_ok == len(prompts)
    assert metric(d_url, "vllm:fabric_load_failures_total") == 0
    ext = metric(d_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = metric(d_url, "vllm:prompt_tokens_by_source_total", source="local_compute")
    # Every prompt token but the last (which the decoder recomputes) arrived.
    assert ext - before_ext >= sum(PROMPT_LENGTHS) - len(prompts)
    assert local - before_local <= len(prompts)
    proxy_metrics = httpx.get(cluster.proxy.url("/metrics"), timeout=10).text
    assert re.search(r"^fabric_proxy_fallbacks_total 0$", proxy_metrics, re.M)


def test_decoder_recomputes_when_no_kv_arrives(cluster: Cluster) -> None:
    """A transfer that never comes (its prefiller died): bounded wait, then recompute."""
    d_url = cluster.decode.base_url
    prompt = prompt_ids(700, seed=1000)
    want = complete(cluster.colocated.url("/v1/completions"), body(prompt))
    failures = metric(d_url, "vllm:fabric_load_failures_total")
    payload = body(prompt) | {
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": uuid.uuid4().hex,
            "num_tokens": len(prompt),
        }
    }
    t0 = time.monotonic()
    got = complete(cluster.decode.url("/v1/completions"), payload)
    assert time.monotonic() - t0 < FALLBACK_BOUND_S
    assert_same(got, want)
    assert metric(d_url, "vllm:fabric_load_failures_total") == failures + 1
    log = Path(cluster.decode.process.log_path).read_text(errors="replace")
    assert "vLLM recomputes the prompt" in log


def test_prefiller_killed_the_proxy_falls_back_to_the_decoder(cluster: Cluster) -> None:
    """Runs last in this module: it kills the prefiller."""
    prompt = prompt_ids(900, seed=2000)
    want = complete(cluster.colocated.url("/v1/completions"), body(prompt))
    cluster.prefill.process.stop(timeout=0)  # SIGTERM, then SIGKILL at once
    t0 = time.monotonic()
    got = complete(cluster.proxy.url("/v1/completions"), body(prompt))
    assert time.monotonic() - t0 < FALLBACK_BOUND_S
    assert_same(got, want)
    proxy_metrics = httpx.get(cluster.proxy.url("/metrics"), timeout=10).text
    assert re.search(r"^fabric_proxy_fallbacks_total 1$", proxy_metrics, re.M)
