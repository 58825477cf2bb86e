"""1P1D on real vLLM: the proxy pairs a prefiller and a decoder, fabric moves the KV.

Oracle: a third, colocated engine serving the same model. For every prompt
the decoder's tokens must equal the colocated engine's, and its logprobs
must be within a few bf16 steps (the decoder recomputes the last prompt
token with its decode kernel). The decoder's own metrics must show the
prompt came over the fabric, not from local compute.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.launch.process import free_port
from tests.e2e._engines import EngineFactory
from tests.e2e._pd import (
    FALLBACK_BOUND_S,
    PROMPT_LENGTHS,
    Proxy,
    assert_same,
    body,
    complete,
    kv_config,
    metric,
    prompt_ids,
)

pytestmark = pytest.mark.e2e

# NOTE: the other e2e modules raise the lookup bound to count hits; this one
# runs the default
DEFAULT_LOOKUP_MS = ConnectorConfig().lookup_timeout_ms


class Cluster:
    def __init__(self, engines: EngineFactory, model_dir: Path) -> None:
        self.kv_port = free_port()
        specs = {
            "colocated": {"cpu_cores": "0"},
            "prefill": {
                "cpu_cores": "0",
                "kv_transfer_config": kv_config("kv_producer", lookup_timeout_ms=DEFAULT_LOOKUP_MS),
            },
            "decode": {
                "cpu_cores": "1",
                "kv_transfer_config": kv_config(
                    "kv_consumer", kv_port=self.kv_port, lookup_timeout_ms=DEFAULT_LOOKUP_MS
                ),
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
        self.proxy = Proxy([self.prefill.base_url], [(self.decode.base_url, self.kv_port)])


@pytest.fixture(scope="module")
def cluster(engines: EngineFactory, tiny_model_dir: Path) -> Iterator[Cluster]:
    c = Cluster(engines, tiny_model_dir)
    yield c
    c.proxy.stop()


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


LEAVE_MAX_TOKENS = 3000
LEAVE_TRIES = 3


def test_client_leaving_mid_stream_aborts_the_decode(cluster: Cluster) -> None:
    """The proxy drops D's stream when the client goes; vLLM aborts the request.

    Signals: D's generated-token counter, read as soon as the client has
    left, moves little after that (vLLM's running gauge lags too much to
    test), and D never finishes the request at its length (an aborted
    request is not counted in ``vllm:request_success_total``; one D kept
    would be, with ``finished_reason="length"``: 3,000 tokens, ``ignore_eos``).

    NOTE: a try where D had generated half the answer or more by then has
    too little left to tell an abort apart; it is repeated, up to 3 tries.
    Seen on a busy machine: the proxy's process got no CPU for 12 s (a
    separate sampler process stalled as long), while D, pinned to its own
    core, generated all 3,000 tokens before the proxy relayed the first.
    """
    d_url = cluster.decode.base_url
    generated = partial(metric, d_url, "vllm:generation_tokens_total")
    ran_out = partial(metric, d_url, "vllm:request_success_total", finished_reason="length")
    at_leave: list[float] = []
    for attempt in range(LEAVE_TRIES):
        before, ran_out_before = generated(), ran_out()
        prompt = prompt_ids(300, seed=3000 + attempt)
        payload = body(prompt, stream=True) | {"max_tokens": LEAVE_MAX_TOKENS}
        with (
            httpx.Client(timeout=60, trust_env=False) as client,
            client.stream("POST", cluster.proxy.url("/v1/completions"), json=payload) as response,
        ):
            chunks = response.iter_raw()
            assert next(chunks).startswith(b"data: ")
            chunks.close()
        at_leave.append(generated() - before)
        if at_leave[-1] < LEAVE_MAX_TOKENS / 2:
            break
        _wait_until_stable(generated)
    else:
        pytest.fail(
            f"in {LEAVE_TRIES} tries D had generated half its answer or more when the client "
            f"left (tokens by then: {at_leave}): nothing left to test"
        )
    after_leave = _wait_until_stable(generated) - before - at_leave[-1]
    assert after_leave < LEAVE_MAX_TOKENS / 2, (
        f"D generated {after_leave:g} tokens after the client left "
        f"({at_leave[-1]:g} before): not aborted"
    )
    assert ran_out() == ran_out_before, "D finished the request at its length: not aborted"
    exported = httpx.get(d_url + "/metrics", timeout=30).text
    assert "vllm:request_success_total{" in exported  # NOTE: else both reads were 0


def _wait_until_stable(read: Callable[[], float], quiet_s: float = 3, bound_s: float = 30) -> float:
    """``read()``'s value once it stayed the same for ``quiet_s``."""
    last, stable_since = -1.0, time.monotonic()
    deadline = time.monotonic() + bound_s
    while time.monotonic() - stable_since < quiet_s:
        assert time.monotonic() < deadline, f"still moving after {bound_s} s: {last:g}"
        now = read()
        if now != last:
            last, stable_since = now, time.monotonic()
        time.sleep(0.2)
    return last


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
