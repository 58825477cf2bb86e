"""Faults on real vLLM engines: every request ends correct or with a clear error,
in bounded time, and no store keeps a reserved slot afterwards.

Engines (tiny model): a colocated oracle; a prefiller whose transfers are all
corrupted in flight (fault injection); a prefiller whose writes are delayed
3 s (so it can be killed mid-transfer); one decoder with a 4-chunk store
(so a longer prompt finds its pool full). Proxies run in this process, one
per scenario's prefiller, and are restarted at will.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabric.launch.process import free_port
from fabric.transfer.store_client import StoreClient
from tests.e2e._engines import Engine, EngineFactory
from tests.e2e._pd import Proxy, assert_same, body, complete, kv_config, metric, prompt_ids

pytestmark = pytest.mark.e2e

DEADLINE_S = 60.0  # every request of this module ends within this
LOAD_TIMEOUT_S = 5
SLOTS = 4  # decoder store: 4 chunks of 256 tokens


class Cluster:
    def __init__(self, engines: EngineFactory, model_dir: Path) -> None:
        self.ports = {name: free_port() for name in ("bad", "slow", "decode")}
        specs: dict[str, dict[str, Any]] = {
            "colocated": {"cpu_cores": "0"},
            "bad": {
                "cpu_cores": "0",
                "kv_transfer_config": kv_config(
                    "kv_producer", kv_port=self.ports["bad"], faults={"corrupt": 1.0}
                ),
            },
            "slow": {
                "cpu_cores": "1",
                "kv_transfer_config": kv_config(
                    "kv_producer", kv_port=self.ports["slow"], faults={"delay_ms": 3000}
                ),
            },
            "decode": {
                "cpu_cores": "1",
                "kv_transfer_config": kv_config(
                    "kv_consumer",
                    kv_port=self.ports["decode"],
                    store_slots=SLOTS,
                    load_timeout_s=LOAD_TIMEOUT_S,
                ),
            },
        }
        self.engines: dict[str, Engine] = engines.start_many(model_dir, specs)
        self.proxies: list[Proxy] = []
        self.killed: set[str] = set()

    def kill(self, name: str) -> None:
        """SIGKILL an engine's process group (its exit may take a while to finish)."""
        self.killed.add(name)
        self.engines[name].process.stop(timeout=0)

    def proxy(self, prefill: str) -> Proxy:
        decode = self.engines["decode"]
        proxy = Proxy(
            [self.engines[prefill].base_url],
            [(decode.base_url, self.ports["decode"])],
            prefill_timeout_s=30,
            decode_timeout_s=30,
        )
        self.proxies.append(proxy)
        return proxy

    def want(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        return complete(self.engines["colocated"].url("/v1/completions"), body(prompt))

    def reserved(self) -> dict[str, int]:
        """Reserved slots now, per engine store still alive."""
        out = {}
        for name, port in self.ports.items():
            if name in self.killed:
                continue
            with StoreClient(f"tcp://127.0.0.1:{port}", timeout_ms=5000) as store:
                out[name] = int(store.stats()["reserved"])
        return out

    def wait_no_reserved(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while any(self.reserved().values()):
            assert time.monotonic() < deadline, f"reserved slots left: {self.reserved()}"
            time.sleep(0.5)

    def stop_proxies(self) -> None:
        for proxy in self.proxies:
            proxy.stop()


@pytest.fixture(scope="module")
def cluster(engines: EngineFactory, tiny_model_dir: Path) -> Iterator[Cluster]:
    c = Cluster(engines, tiny_model_dir)
    yield c
    c.stop_proxies()


def timed(fn: Any, *args: Any) -> Any:
    started = time.monotonic()
    result = fn(*args)
    assert time.monotonic() - started < DEADLINE_S
    return result


def test_corrupted_transfer_is_detected_and_recomputed(cluster: Cluster) -> None:
    d_url = cluster.engines["decode"].base_url
    failures = metric(d_url, "vllm:fabric_load_failures_total")
    proxy = cluster.proxy("bad")
    for seed in range(3):
        prompt = prompt_ids(600, seed=4000 + seed)
        assert_same(
            timed(complete, proxy.url("/v1/completions"), body(prompt)), cluster.want(prompt)
        )
    assert metric(d_url, "vllm:fabric_load_failures_total") - failures == 3
    assert metric(d_url, "vllm:fabric_loads_ok_total") == 0  # nothing corrupt was used
    cluster.wait_no_reserved()


def test_decoder_pool_full_falls_back_to_recompute(cluster: Cluster) -> None:
    proxy = cluster.proxy("bad")
    prompt = prompt_ids(SLOTS * 256 + 500, seed=4100)  # 6 chunks > 4 slots: Reserve refused
    assert_same(timed(complete, proxy.url("/v1/completions"), body(prompt)), cluster.want(prompt))
    log = Path(cluster.engines["bad"].process.log_path).read_text(errors="replace")
    assert "capacity" in log or "no free" in log
    cluster.wait_no_reserved()


def test_proxy_restarted_mid_request(cluster: Cluster) -> None:
    proxy = cluster.proxy("bad")
    payload = body(prompt_ids(500, seed=4200), stream=True) | {"max_tokens": 2000}
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", proxy.url("/v1/completions"), json=payload, timeout=30) as r:
                for _ in r.iter_raw():
                    pass
        except httpx.HTTPError as exc:
            errors.append(exc)

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(2.0)
    # a crash, not a graceful stop: uvicorn drops open connections at once
    proxy.server.should_exit = proxy.server.force_exit = True
    proxy.thread.join(timeout=15)
    thread.join(timeout=DEADLINE_S)
    assert not thread.is_alive()
    again = cluster.proxy("bad")
    prompt = prompt_ids(300, seed=4201)
    assert_same(timed(complete, again.url("/v1/completions"), body(prompt)), cluster.want(prompt))
    cluster.wait_no_reserved()


def test_prefiller_killed_mid_transfer(cluster: Cluster) -> None:
    proxy = cluster.proxy("slow")
    prompt = prompt_ids(700, seed=4300)
    want = cluster.want(prompt)
    result: list[Any] = []
    thread = threading.Thread(
        target=lambda: result.append(timed(complete, proxy.url("/v1/completions"), body(prompt)))
    )
    thread.start()
    time.sleep(1.5)  # P answered the prefill; its writes wait 3 s: kill it now
    cluster.kill("slow")
    thread.join(timeout=DEADLINE_S)
    assert result, "the request did not finish"
    assert_same(result[0], want)
    cluster.wait_no_reserved()


def test_decoder_killed_requests_fail_clearly(cluster: Cluster) -> None:
    """Runs last: it kills the only decoder."""
    proxy = cluster.proxy("bad")
    cluster.kill("decode")
    started = time.monotonic()
    response = httpx.post(proxy.url("/v1/completions"), json=body([5] * 50), timeout=DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S
    assert response.status_code in (502, 503, 504)
    assert response.json()["error"]["message"]
    cluster.wait_no_reserved()
