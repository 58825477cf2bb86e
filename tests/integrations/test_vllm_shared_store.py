"""The connector and the host's shared store: save to it, fetch from it, survive its death.

Scheduler side with fakes (what it asks, what it plans); worker side with two
real workers (small random CPU caches, no vLLM) and a real shared store, all
in this process over the loopback data plane.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import FabricCounters
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan
from fabric.integrations.vllm.scheduler import FabricScheduler
from fabric.integrations.vllm.tier_client import SharedTierClient, WorkerTierClient
from fabric.integrations.vllm.worker import FabricWorker
from fabric.kv.identity import KeyIdentity
from fabric.shared_store.service import ServiceConfig, SharedStore
from tests.integrations.test_vllm_reuse_scheduler import FakeTier
from tests.integrations.test_vllm_reuse_worker import TOKENS, make, save_prompt
from tests.integrations.test_vllm_scheduler import BS, CT, Cached, NewReq, Out, Req

CB = CT // BS


# ---------------------------------------------------------------- scheduler
class FakeShared:
    """Holds ``chunks`` leading chunks of every prompt; records fetches."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.calls: list[tuple[str, int, int]] = []

    def fetch(
        self, transfer_id: str, token_ids: list[int], min_chunks: int, identity: KeyIdentity
    ) -> int:
        self.calls.append((transfer_id, len(token_ids), min_chunks))
        hit = min(self.chunks, len(token_ids) // CT)
        return hit if hit > min_chunks else 0

    def ask(
        self,
        transfer_id: str,
        token_ids: list[int],
        min_chunks: int,
        identity: KeyIdentity,
        wait_s: float,
    ) -> int | None:
        return self.fetch(transfer_id, token_ids, min_chunks, identity)

    def cancel(self, transfer_id: str) -> None:
        return

    def poll(self) -> None:
        return

    def table_sizes(self) -> dict[str, int]:
        return {}


def sched(own: int, shared: int) -> tuple[FabricScheduler, FakeShared]:
    config = ConnectorConfig(chunk_tokens=CT, lease_ms=10_000)
    fake = FakeShared(shared)
    s = FabricScheduler(config, BS, produce=True, consume=True, tier=FakeTier(own), shared=fake)
    return s, fake


def test_a_longer_shared_hit_is_fetched_and_loaded_asynchronously() -> None:
    s, shared = sched(own=1, shared=3)
    req = Req("r1", list(range(300)))  # 4 full chunks + 44: 4 usable
    assert s.get_num_new_matched_tokens(req, 16) == (3 * CT - 16, True)
    [(transfer_id, num_tokens, min_chunks)] = shared.calls
    assert (num_tokens, min_chunks) == (4 * CT, 1)  # only beyond the own store's chunk
    # vLLM has no blocks yet and asks again: same answer, no second fetch
    assert s.get_num_new_matched_tokens(req, 16) == (3 * CT - 16, True)
    assert len(shared.calls) == 1
    blocks = list(range(50, 69))
    s.update_state_after_alloc(req, blocks, 3 * CT - 16)
    meta = s.build_connector_meta(Out([], Cached(), {}))
    [load] = meta.loads
    assert (load.transfer_id, load.first_block, load.num_tokens) == (transfer_id, 1, 3 * CT)
    assert load.shared and load.block_ids == blocks[1:12]
    assert meta.releases == ["r1"]  # the own store's hold is let go
    assert not meta.local_loads


def test_a_shared_hit_no_longer_than_the_own_store_loads_from_the_own_store() -> None:
    s, shared = sched(own=3, shared=3)
    req = Req("r1", list(range(300)))
    assert s.get_num_new_matched_tokens(req, 0) == (3 * CT, False)
    assert shared.calls[0][2] == 3
    s.update_state_after_alloc(req, list(range(20)), 3 * CT)
    meta = s.build_connector_meta(Out([NewReq("r1", (list(range(20)),), 3 * CT)], Cached(), {}))
    assert [ll.num_chunks for ll in meta.local_loads] == [3] and not meta.loads


def test_a_request_is_fetched_once_even_when_its_load_failed() -> None:
    s, shared = sched(own=0, shared=4)
    req = Req("r1", list(range(300)))
    assert s.get_num_new_matched_tokens(req, 0) == (4 * CT, True)
    s.update_state_after_alloc(req, list(range(20)), 4 * CT)
    s.build_connector_meta(Out([], Cached(), {}))
    # the load failed: vLLM schedules the request again from scratch
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len(shared.calls) == 1


# ---------------------------------------------------------------- workers
@pytest.fixture
def service() -> Iterator[SharedStore]:
    store = SharedStore(ServiceConfig(mem_bytes=4 << 20, transport="loopback")).start()
    yield store
    store.close()


def wait_counts(w: FabricWorker, name: str, want: int, timeout: float = 10) -> dict:
    """Counters since the last call, once ``name`` reached ``want`` (pushes run behind)."""
    deadline, total = time.monotonic() + timeout, {}
    while True:
        for key, value in w.counters.take().items():
            total[key] = total.get(key, 0) + value if isinstance(value, int) else value
        if total.get(name, 0) >= want or time.monotonic() > deadline:
            return total
        time.sleep(0.02)


def test_chunks_one_worker_saved_load_into_a_fresh_worker(service: SharedStore) -> None:
    a = make(seed=1, shared_store=service.endpoint)
    b = make(seed=2, shared_store=service.endpoint)  # other caches, empty store
    try:
        src = list(range(0, 16))
        save_prompt(a, "r1", src)
        counts = wait_counts(a, "shared_store_saved_chunks", 4)
        assert counts["chunks_saved"] == 4 and counts["shared_store_saved_chunks"] == 4
        save_prompt(a, "r1-again", src)  # same chunks: nothing new for the shared store
        assert (
            wait_counts(a, "shared_store_saved_chunks", 1, timeout=1).get(
                "shared_store_saved_chunks", 0
            )
            == 0
        )

        config = ConnectorConfig(chunk_tokens=CT, shared_store=service.endpoint)
        worker_tier = WorkerTierClient(config, tp_size=1, engine_id=b.engine_id)
        counters = FabricCounters()
        client = SharedTierClient(config, worker_tier, counters)
        assert client.fetch("shared-r2", TOKENS[: 4 * CT], 0) == 4
        dst = list(range(20, 36))
        b.start_load(
            FabricMetadata(
                loads=[LoadPlan("r2", "shared-r2", 0, dst, 4 * CT, TOKENS[: 4 * CT], shared=True)]
            )
        )
        deadline = time.monotonic() + 10
        while not (results := b.get_results(set()))[0]:
            assert time.monotonic() < deadline, "the fetched chunks never loaded"
            time.sleep(0.02)
        assert results == ({"r2"}, set())
        for layer_a, layer_b in zip(a.kv_caches, b.kv_caches, strict=True):
            assert torch.equal(layer_a[src], layer_b[dst])
        counts = b.counters.take()
        assert counts["shared_store_loaded_chunks"] == 4
        assert counts["shared_store_loaded_tokens"] == 4 * CT
        assert "loads_ok" not in counts and not counters.take()
        assert b.tier is not None and b.tier.lookup(TOKENS[: 4 * CT]).chunks == 4  # kept
        client.close()
        worker_tier.close()
    finally:
        a.shutdown()
        b.shutdown()


def test_a_mismatched_worker_is_refused_and_keeps_serving(service: SharedStore) -> None:
    a = make(seed=1, shared_store=service.endpoint)
    other = make(seed=3, shared_store=service.endpoint, chunk_tokens=2 * CT)
    try:
        assert other.shared is not None and other.shared.refused
        assert a.shared is not None and not a.shared.refused
    finally:
        a.shutdown()
        other.shutdown()


def test_a_dead_shared_store_never_blocks_saving_or_lookups() -> None:
    dead = "127.0.0.1:9"  # nothing listens on the discard port here
    started = time.monotonic()
    w = make(seed=1, shared_store=dead, lookup_timeout_ms=200)
    try:
        assert time.monotonic() - started < 5  # one bounded attach at start
        t0 = time.monotonic()
        save_prompt(w, "r1", list(range(16)))
        assert time.monotonic() - t0 < 0.5  # the model thread never waits for it
        counts = wait_counts(w, "shared_store_failures", 2)
        assert counts["chunks_saved"] == 4  # its own store still keeps them
        assert counts["shared_store_failures"] >= 2  # attach at start, then the push

        config = ConnectorConfig(chunk_tokens=CT, shared_store=dead, lookup_timeout_ms=200)
        counters = FabricCounters()
        client = SharedTierClient(
            config, WorkerTierClient(config, tp_size=1, engine_id=w.engine_id), counters
        )
        assert client.fetch("t1", TOKENS[: 4 * CT], 0) == 0
        # nothing listens: a hard failure, so it backs off at once, saying why
        assert client.backoff.skipping() and "no connection took Fetch" in client.backoff.reason
        assert client.fetch("t2", TOKENS[: 4 * CT], 0) == 0  # backing off: not asked
        assert counters.take() == {"shared_store_failures": 1, "lookup_backoffs": 1}
        client.close()
    finally:
        w.shutdown()


def test_a_shared_store_with_no_more_is_asked_once_not_every_step() -> None:
    s, shared = sched(own=2, shared=1)
    req = Req("r1", list(range(300)))
    for _ in range(3):  # waiting for blocks: vLLM asks every step
        assert s.get_num_new_matched_tokens(req, 0) == (2 * CT, False)
    assert len(shared.calls) == 1
