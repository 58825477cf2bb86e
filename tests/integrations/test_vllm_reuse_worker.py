"""Worker side of the reuse tier: save, look up over the control channel, load.

One worker (no vLLM engine) with small random CPU-layout caches; the
scheduler's ``WorkerTierClient`` asks the worker's real control endpoint,
and the disk tier is a real directory, reopened to stand for a restart.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.metadata import FabricMetadata, LocalLoad, PackChunk, SendPlan
from fabric.integrations.vllm.tier_client import WorkerTierClient
from fabric.integrations.vllm.worker import FabricWorker
from fabric.transfer import protocol as proto
from fabric.transfer.store_client import StoreClient
from tests.integrations.test_vllm_worker import BS, CT, caches

CB = CT // BS  # blocks per chunk
TOKENS = list(range(1000, 1000 + 4 * CT + 10))  # 4 full chunks + 10 tokens


def make(tmp: Path | None = None, *, seed: int = 1, **extra: object) -> FabricWorker:
    settings: dict[str, object] = {"transport": "loopback", "chunk_tokens": CT, "store_mib": 4}
    if tmp is not None:
        settings |= {"disk_path": str(tmp / "disk"), "disk_gib": 0.01}
    config = ConnectorConfig.from_extra(settings | extra)
    w = FabricWorker(
        config, produce=True, consume=True, block_size=BS, model="tiny", engine_id=f"e{seed}"
    )
    w.register_kv_caches(caches(seed))
    return w


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[FabricWorker]:
    w = make(tmp_path)
    yield w
    w.shutdown()


def save_prompt(w: FabricWorker, rid: str, blocks: list[int]) -> None:
    counts = [CB] * 4
    packs = [PackChunk(rid, i, blocks[i * CB : (i + 1) * CB]) for i in range(4)]
    w.pack_step(
        FabricMetadata(sends=[SendPlan(rid, None, None, TOKENS[: 4 * CT], counts)], packs=packs)
    )
    w.before_step()  # the next step: joins the packing (async_save)


def tier_client(w: FabricWorker) -> WorkerTierClient:
    config = ConnectorConfig(chunk_tokens=CT, lookup_timeout_ms=2000)
    return WorkerTierClient(config, tp_size=1, engine_id=w.engine_id)


def assert_blocks_equal(w: FabricWorker, a: list[int], b: list[int]) -> None:
    for layer in w.kv_caches:
        assert torch.equal(layer[a], layer[b])


def test_saved_chunks_load_into_other_blocks(worker: FabricWorker) -> None:
    src = list(range(0, 16))
    save_prompt(worker, "r1", src)
    assert worker.counters.take()["chunks_saved"] == 4
    client = tier_client(worker)
    # the scheduler leaves the last token: 4 full chunks of 4*CT+10 tokens are all usable
    assert client.lookup("r2", TOKENS[: 4 * CT]) == 4
    dst = list(range(20, 36))
    worker.start_load(FabricMetadata(local_loads=[LocalLoad("r2", 0, dst, 4)]))
    assert_blocks_equal(worker, src, dst)
    counts = worker.counters.take()
    assert counts["store_hit_chunks"] == 4 and counts["store_hit_tokens"] == 4 * CT
    [seconds] = counts["store_load_seconds"]
    assert 0 < seconds < 10
    assert worker.tier is not None and worker.tier.held_count() == 0
    assert worker.store.stats().filled == 4  # refs dropped: all evictable again
    client.close()


def test_a_local_prefix_hit_loads_only_the_blocks_after_it(worker: FabricWorker) -> None:
    src = list(range(0, 16))
    save_prompt(worker, "r1", src)
    client = tier_client(worker)
    assert client.lookup("r2", TOKENS[: 4 * CT]) == 4
    # vLLM already holds the first 6 blocks (1.5 chunks) itself
    dst = list(range(26, 36))
    before = [layer[20:26].clone() for layer in worker.kv_caches]
    worker.start_load(FabricMetadata(local_loads=[LocalLoad("r2", 6, dst, 4)]))
    assert_blocks_equal(worker, src[6:], dst)
    for layer, old in zip(worker.kv_caches, before, strict=True):
        assert torch.equal(layer[20:26], old)
    counts = worker.counters.take()
    assert counts["store_hit_tokens"] == 4 * CT - 6 * BS and counts["store_hit_chunks"] == 3
    client.close()


def test_prefix_lookup_stops_at_the_first_missing_chunk(worker: FabricWorker) -> None:
    save_prompt(worker, "r1", list(range(16)))
    other = TOKENS[:CT] + [7] * (3 * CT)  # shares chunk 0 only
    with StoreClient(worker.node.endpoint) as client:  # type: ignore[union-attr]
        result = client.lookup(other)
        assert (result.hit_chunks, result.chunk_tokens, result.held) == (1, CT, False)


def test_lost_hold_reports_the_blocks_as_load_errors(worker: FabricWorker) -> None:
    dst = list(range(20, 36))
    worker.start_load(FabricMetadata(local_loads=[LocalLoad("never-held", 0, dst, 4)]))
    assert worker.take_load_errors() == set(dst)
    assert worker.take_load_errors() == set()
    assert worker.counters.take()["store_load_failures"] == 1


def test_release_drops_an_unused_hold(worker: FabricWorker) -> None:
    save_prompt(worker, "r1", list(range(16)))
    client = tier_client(worker)
    assert client.lookup("r2", TOKENS[: 4 * CT]) == 4
    assert worker.tier is not None and worker.tier.held_count() == 1
    worker.start_load(FabricMetadata(releases=["r2"]))
    assert worker.tier.held_count() == 0
    assert worker.store.stats().filled == 4
    client.close()


def test_a_release_applied_while_the_lookup_reads_from_disk_leaves_no_hold(
    worker: FabricWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's release reaches the worker in-process (``start_load``)
    while its lookup still reads the chunks back from disk on a server
    thread: once that read ends nothing is held, no slot stays referenced."""
    save_prompt(worker, "r1", list(range(16)))
    tier = worker.tier
    assert tier is not None and tier.disk is not None and tier.flush(10)
    assert worker.store.drop_unused() == 4  # on disk only: the lookup reads them in
    real_read, parked, gate = tier.disk.read_into, threading.Event(), threading.Event()

    def parked_read(key: bytes, out: object) -> int | None:
        parked.set()
        assert gate.wait(60), "the test never opened the gate"
        return real_read(key, out)

    monkeypatch.setattr(tier.disk, "read_into", parked_read)
    client = StoreClient(worker.node.endpoint, timeout_ms=60_000)  # type: ignore[union-attr]
    answers: list[proto.LookupResult] = []
    lookup = threading.Thread(
        target=lambda: answers.append(client.lookup(TOKENS[: 4 * CT], hold="r2")), daemon=True
    )
    try:
        lookup.start()
        assert parked.wait(30), "the lookup never read from disk"
        worker.start_load(FabricMetadata(releases=["r2"]))  # the scheduler let r2 go
    finally:
        gate.set()
        lookup.join(60)
        client.close()
    assert answers and not answers[0].held
    assert tier.held_count() == 0 and tier.take_held("r2") is None
    assert worker.store.table_sizes()["store_referenced_slots"] == 0
    assert worker.table_sizes()["tier_holds"] == 0


def test_restart_reuses_chunks_from_disk_and_skips_a_corrupt_one(tmp_path: Path) -> None:
    first = make(tmp_path, seed=1)
    save_prompt(first, "r1", list(range(16)))
    assert first.tier is not None and first.tier.flush(10)
    expected = [layer[0:16].clone() for layer in first.kv_caches]
    first.shutdown()
    # flip one byte in chunk 2's file (payload, not header)
    files = sorted((tmp_path / "disk").rglob("*.chunk"))
    assert len(files) == 4
    keys = make_keys()
    victim = next(f for f in files if f.stem == keys[2].hex())
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))

    second = make(tmp_path, seed=2)  # other random caches: only disk can explain equality
    try:
        client = tier_client(second)
        assert client.lookup("r2", TOKENS[: 4 * CT]) == 2  # chunk 2 corrupt: hit stops there
        dst = list(range(20, 28))
        second.start_load(FabricMetadata(local_loads=[LocalLoad("r2", 0, dst, 2)]))
        for layer, old in zip(second.kv_caches, expected, strict=True):
            assert torch.equal(layer[dst], old[0:8])
        second.sync_tier_counters()
        counts = second.counters.take()
        assert counts["disk_hit_chunks"] == 2 and counts["disk_corrupt_chunks"] == 1
        assert not victim.exists()  # deleted, never loaded
        client.close()
    finally:
        second.shutdown()


def test_dead_worker_costs_one_bounded_timeout(tmp_path: Path) -> None:
    from fabric.launch.process import free_port

    config = ConnectorConfig(chunk_tokens=CT, kv_port=free_port(), lookup_timeout_ms=200)
    client = WorkerTierClient(config, tp_size=1, engine_id=None)
    assert client.lookup("r1", TOKENS[: 4 * CT]) == 0  # nobody listens: a miss
    assert client.lookup("r2", TOKENS[: 4 * CT]) == 0  # backing off: no second wait
    client.close()


def make_keys() -> list[bytes]:
    w = make(None, seed=3)
    try:
        assert w.tier is not None
        return w.tier.keys(TOKENS[: 4 * CT])
    finally:
        w.shutdown()


def test_stats_aggregate_counters_and_latency_samples() -> None:
    pytest.importorskip("vllm")
    from fabric.integrations.vllm.stats import FabricStats

    a = FabricStats(data={"chunks_saved": 2, "load_seconds": [0.1]})
    a.aggregate(FabricStats(data={"chunks_saved": 3, "load_seconds": [0.3, 0.2]}))
    assert a.data == {"chunks_saved": 5, "load_seconds": [0.1, 0.3, 0.2]}
    assert a.reduce() == {"chunks_saved": 5, "load_seconds (mean of 3)": 0.2}
    assert not a.is_empty() and FabricStats(data={"load_seconds": []}).is_empty()


def test_endpoint_file_lets_the_scheduler_find_a_free_port_and_goes_away(tmp_path: Path) -> None:
    from fabric.integrations.vllm.config import endpoint_file

    w = make(None, seed=9)
    path = endpoint_file("e9", 0)
    assert w.node is not None and path.read_text() == w.node.endpoint
    w.shutdown()
    assert not path.exists()
    client = tier_client(w)  # nobody there any more: a miss, not a hang
    assert client.lookup("r1", TOKENS[: 4 * CT]) == 0
    client.close()


def test_async_save_packs_before_the_next_forward_overwrites_the_blocks(
    worker: FabricWorker,
) -> None:
    """The chunks of a step are packed on the fabric-pack thread, and the next
    step's ``before_step`` (vLLM's ``handle_preemptions``) joins it: blocks
    rewritten after that (a finished request's blocks handed to another) do
    not reach the store."""
    assert worker._packer is not None
    src = list(range(0, 16))
    original = [layer[src].clone() for layer in worker.kv_caches]
    counts = [CB] * 4
    packs = [PackChunk("r1", i, src[i * CB : (i + 1) * CB]) for i in range(4)]
    sends = [SendPlan("r1", None, None, TOKENS[: 4 * CT], counts)]
    worker.pack_step(FabricMetadata(sends=sends, packs=packs))
    worker.get_results({"r1"})  # the request finished in the same step
    worker.before_step()
    for layer in worker.kv_caches:  # the next forward writes the freed blocks
        layer[src] = 0
    client = tier_client(worker)
    assert client.lookup("r2", TOKENS[: 4 * CT]) == 4
    dst = list(range(20, 36))
    worker.start_load(FabricMetadata(local_loads=[LocalLoad("r2", 0, dst, 4)]))
    for layer, want in zip(worker.kv_caches, original, strict=True):
        assert torch.equal(layer[dst], want)
    client.close()


def test_a_store_chunk_corrupted_after_it_was_saved_is_recomputed(worker: FabricWorker) -> None:
    src = list(range(0, 16))
    save_prompt(worker, "r1", src)
    client = tier_client(worker)
    assert client.lookup("r2", TOKENS[: 4 * CT]) == 4
    client.close()
    assert worker.tier is not None
    slots = worker.tier._holds["r2"].slots
    worker.store.pool.slot_view(slots[2]).view(torch.uint8)[7] ^= 0x01
    dst = list(range(20, 36))
    worker.start_load(FabricMetadata(local_loads=[LocalLoad("r2", 0, dst, 4)]))
    assert worker.take_load_errors() == set(dst)
    counts = worker.counters.take()
    assert counts["corrupt_chunks"] == 1 and counts["store_load_failures"] == 1
