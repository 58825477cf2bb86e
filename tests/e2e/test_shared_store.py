"""The host's shared store on real vLLM: a prefix outlives the engine that computed it.

``fabric store serve`` runs as its own process. Engine A (kv_both, its own
store, ``shared_store`` set) serves an 8-chunk prompt and pushes every full
chunk to the shared store; A is stopped. A fresh engine B -- another engine
id, an empty store, no disk -- serves the same prompt: its scheduler fetches
the prefix from the shared store into B's store, the worker loads it
asynchronously, and vLLM computes only the tail, with A's output. vLLM's own
prefix cache is off in both, so nothing else can answer the repeat.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.launch.process import ManagedProcess, free_port
from fabric.transfer.store_client import StoreClient
from tests.e2e._engines import Engine, EngineFactory
from tests.e2e._pd import CHUNK_TOKENS, assert_same, body, complete, kv_config, metric, prompt_ids

pytestmark = pytest.mark.e2e

FULL_CHUNKS = 8
TAIL = 100
PROMPT_LEN = FULL_CHUNKS * CHUNK_TOKENS + TAIL


class SharedStoreProcess:
    """``fabric store serve`` in a subprocess, stopped by pid."""

    def __init__(self, workdir: Path) -> None:
        endpoint_file = workdir / "store.endpoint"
        argv = [sys.executable, "-m", "fabric.cli", "store", "serve", "--mem-gib", "0.25"]
        argv += ["--endpoint-file", str(endpoint_file)]
        self.process = ManagedProcess(argv, log_path=workdir / "store.log", name="store")
        deadline = time.monotonic() + 60
        while not endpoint_file.exists():
            assert self.process.alive(), self.process.log_tail()
            assert time.monotonic() < deadline, self.process.log_tail()
            time.sleep(0.1)
        self.endpoint = endpoint_file.read_text().strip()

    def stats(self) -> dict[str, int]:
        with StoreClient(self.endpoint) as client:
            return client.stats()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStoreProcess]:
    store = SharedStoreProcess(tmp_path_factory.mktemp("shared-store"))
    try:
        yield store
    finally:
        store.process.stop()


def start(engines: EngineFactory, model_dir: Path, name: str, endpoint: str) -> Engine:
    config = kv_config("kv_both", kv_port=free_port(), store_mib=64, shared_store=endpoint)
    return engines.start(
        model_dir,
        name=name,
        cpu_cores="0",
        kv_transfer_config=config,
        extra_args=["--no-enable-prefix-caching"],
    )


def fabric_metric(engine: Engine, name: str) -> float:
    return metric(engine.base_url, f"vllm:fabric_{name}_total")


def wait_metric(
    engine: Engine, name: str, want: float, timeout: float = 60, *, step: bool = False
) -> float:
    """Wait for the count (``/metrics`` shows a step's counters a little
    after it); ``step``: run one tiny step each round (:func:`step_once`)."""
    deadline = time.monotonic() + timeout
    while (value := fabric_metric(engine, name)) < want and time.monotonic() < deadline:
        if step:
            step_once(engine)
        time.sleep(0.5)
    return value


def wait_filled(store: SharedStoreProcess, want: int, timeout: float = 60) -> int:
    """Pushes to the shared store run behind the model step: wait until the
    store holds ``want`` chunks (its own count)."""
    deadline = time.monotonic() + timeout
    while (filled := store.stats()["filled"]) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return filled


def step_once(engine: Engine) -> None:
    """One request of 3 tokens (no full chunk: nothing saved or looked up),
    so the engine steps: vLLM collects the connector's counters once per step
    (``get_kv_connector_stats``), so what its push threads counted after the
    last request's last step shows only after another step."""
    complete(engine.url("/v1/completions"), body(prompt_ids(3, seed=1)) | {"max_tokens": 1})


def test_a_fresh_engine_loads_a_prefix_another_engine_left_in_the_shared_store(
    engines: EngineFactory, tiny_model_dir: Path, shared_store: SharedStoreProcess
) -> None:
    prompt = prompt_ids(PROMPT_LEN, seed=700)

    a = start(engines, tiny_model_dir, "shared-a", shared_store.endpoint)
    want = complete(a.url("/v1/completions"), body(prompt))
    # NOTE: the old test waited for A's counter alone; a push still running
    # after the request's last step showed 0 there for good (A idle: no step)
    assert wait_filled(shared_store, FULL_CHUNKS) == FULL_CHUNKS
    assert wait_metric(a, "shared_store_saved_chunks", FULL_CHUNKS, step=True) == FULL_CHUNKS
    assert fabric_metric(a, "shared_store_failures") == 0
    a.process.stop()
    assert shared_store.stats()["filled"] == FULL_CHUNKS

    b = start(engines, tiny_model_dir, "shared-b", shared_store.endpoint)
    got = complete(b.url("/v1/completions"), body(prompt))
    assert_same(got, want)
    assert fabric_metric(b, "shared_store_loaded_chunks") == FULL_CHUNKS
    assert fabric_metric(b, "shared_store_loaded_tokens") == FULL_CHUNKS * CHUNK_TOKENS
    assert fabric_metric(b, "store_hit_chunks") == 0  # B's own store started empty
    local = metric(b.base_url, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert local == TAIL  # vLLM computed only the tail
    assert fabric_metric(b, "shared_store_failures") == 0
    # B saved nothing new: the shared store already had every chunk
    step_once(b)
    time.sleep(1.0)  # NOTE: a count that would rise shows a little after the step
    assert fabric_metric(b, "shared_store_saved_chunks") == 0
    stats = shared_store.stats()
    assert stats["filled"] == FULL_CHUNKS
    assert stats["service_attaches"] == 2 and stats["service_fetched_chunks"] == FULL_CHUNKS
