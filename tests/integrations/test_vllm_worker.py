"""Worker side of the FabricConnector: push thread + load thread, no vLLM engine.

A producing and a consuming worker in one process over the loopback data
plane, with small random CPU-layout KV caches standing in for vLLM's.
"""

from __future__ import annotations

import importlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from fabric.errors import ConfigError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import TABLES_KEY
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, PackChunk, SendPlan
from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.integrations.vllm.worker import ENGINE_IDLE_POLL_MS, FabricWorker, rank_endpoint
from fabric.kv.fold64 import fold64_reference
from fabric.store import checksum
from fabric.testing.host_vram import host_backed_vram
from tests.transfer.patterns import loop_wakeups

BS, CT, LAYERS, BLOCKS = 16, 64, 3, 40


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}": torch.randn(BLOCKS, 2, BS, 2 * 8, generator=g).to(torch.bfloat16)
        for i in range(LAYERS)
    }


def worker(*, produce: bool, consume: bool, seed: int, **extra: object) -> FabricWorker:
    config = ConnectorConfig.from_extra(
        {"transport": "loopback", "chunk_tokens": CT, "store_mib": 4, **extra}
    )
    w = FabricWorker(config, produce=produce, consume=consume, block_size=BS, model="tiny")
    w.register_kv_caches(caches(seed))
    return w


def leased_pair(lease_ms: int, **d_extra: object) -> tuple[FabricWorker, FabricWorker]:
    """A producer and a consumer whose leases last ``lease_ms``."""
    p = worker(produce=True, consume=False, seed=1, lease_ms=lease_ms)
    return p, worker(produce=False, consume=True, seed=2, lease_ms=lease_ms, **d_extra)


@pytest.fixture
def pair() -> Iterator[tuple[FabricWorker, FabricWorker]]:
    p = worker(produce=True, consume=False, seed=1)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=3, unknown_transfer_grace_s=0.3)
    yield p, d
    p.shutdown()
    d.shutdown()


def wait_results(d: FabricWorker, timeout: float = 10) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished, failed = d.get_results(set())
        if finished:
            return finished, failed
        time.sleep(0.01)
    raise AssertionError("load never finished")


def tokens(num_tokens: int) -> list[int]:
    """The prompt every test pushes: token ids 0..n-1."""
    return list(range(num_tokens))


def push(p: FabricWorker, endpoint: str, num_tokens: int, src_blocks: list[int]) -> None:
    counts = chunk_block_counts(num_tokens, CT, BS)
    packs, start = [], 0
    for index, n in enumerate(counts):
        packs.append(PackChunk("p-req", index, src_blocks[start : start + n]))
        start += n
    sends = [SendPlan("p-req", "t1", endpoint, tokens(num_tokens), counts)]
    p.pack_step(FabricMetadata(sends=sends, packs=packs))


def assert_the_next_push_loads(p: FabricWorker, d: FabricWorker, transfer_id: str) -> None:
    """After a failure: the next request between the same pair is served normally."""
    assert d.node is not None
    sends = [SendPlan("p2", transfer_id, d.node.endpoint, tokens(64), [4])]
    p.pack_step(FabricMetadata(sends=sends, packs=[PackChunk("p2", 0, [3, 4, 5, 6])]))
    plan = LoadPlan("d2", transfer_id, 0, [14, 15, 16, 17], 64, tokens(64))
    d.start_load(FabricMetadata(loads=[plan]))
    assert wait_results(d) == ({"d2"}, set())


@pytest.mark.parametrize("first_block", [0, 2, 5])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-checksum", "pack-then-hash"])
def test_pushed_kv_lands_in_the_decoders_blocks(
    pair: tuple[FabricWorker, FabricWorker],
    first_block: int,
    fused: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Either way P takes the checksum (its copies here are 1 KiB: the
    fused path is forced), D verifies the chunks it loads against it."""
    pack_module = importlib.import_module("fabric.kv.pack")  # NOTE: fabric.kv.pack is the function
    monkeypatch.setattr(pack_module, "FUSED_MIN_COPY_BYTES", 0 if fused else 1 << 62)
    p, d = pair
    assert d.node is not None
    num_tokens = 150  # chunks of 4, 4, 2 blocks
    src = [7, 8, 9, 10, 30, 31, 1, 2, 3, 4][: -(-num_tokens // BS)]
    push(p, d.node.endpoint, num_tokens, src)
    dst = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    plan = LoadPlan("d-req", "t1", first_block, dst[first_block:], num_tokens, tokens(num_tokens))
    d.start_load(FabricMetadata(loads=[plan]))
    assert wait_results(d) == ({"d-req"}, set())
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for b in range(first_block, len(src)):
            assert torch.equal(d_layer[dst[b]], p_layer[src[b]]), b
    assert d.store.reserved_count() == 0
    counts = d.counters.take()
    assert counts["loads_ok"] == 1 and counts["tokens_loaded"] == num_tokens


def test_unknown_transfer_fails_fast_and_is_counted(
    pair: tuple[FabricWorker, FabricWorker], caplog: pytest.LogCaptureFixture
) -> None:
    _, d = pair
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "nobody", 0, [1, 2], 20, tokens(20))]))
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    # NOTE: failed by the grace for unknown transfers, not the load timeout
    assert "no transfer nobody reached this engine" in caplog.text
    assert d.counters.take()["load_failures"] == 1


def test_missing_chunks_time_out_and_free_the_reservation(
    pair: tuple[FabricWorker, FabricWorker], caplog: pytest.LogCaptureFixture
) -> None:
    p, d = pair
    assert d.node is not None
    counts = chunk_block_counts(150, CT, BS)
    # announce the transfer (reserve) but never compute its chunks
    p.pack_step(
        FabricMetadata(sends=[SendPlan("p-req", "t2", d.node.endpoint, list(range(150)), counts)])
    )
    d.start_load(
        FabricMetadata(loads=[LoadPlan("d-req", "t2", 0, list(range(10)), 150, tokens(150))])
    )
    t0 = time.monotonic()
    assert wait_results(d, timeout=30) == ({"d-req"}, {"d-req"})
    assert time.monotonic() - t0 >= 3  # NOTE: never gives up before load_timeout_s
    assert "not in after" in caplog.text
    assert d.store.reserved_count() == 0


def test_prefiller_reuses_a_chunk_it_already_packed(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    p, d = pair
    assert d.node is not None
    push(p, d.node.endpoint, 64, [3, 4, 5, 6])
    d.start_load(FabricMetadata(loads=[LoadPlan("d1", "t1", 0, [10, 11, 12, 13], 64, tokens(64))]))
    assert wait_results(d) == ({"d1"}, set())
    filled_before = p.store.stats().filled
    counts = chunk_block_counts(64, CT, BS)
    p.pack_step(
        FabricMetadata(
            sends=[SendPlan("p2", "t3", d.node.endpoint, list(range(64)), counts)],
            packs=[PackChunk("p2", 0, [3, 4, 5, 6])],
        )
    )
    d.start_load(FabricMetadata(loads=[LoadPlan("d2", "t3", 0, [14, 15, 16, 17], 64, tokens(64))]))
    assert wait_results(d) == ({"d2"}, set())
    assert p.store.stats().filled == filled_before  # same key: no second pack
    for layer in d.kv_caches:
        assert torch.equal(layer[[10, 11, 12, 13]], layer[[14, 15, 16, 17]])


def test_rank_endpoint_offsets_the_decoders_port_per_tp_rank() -> None:
    """Rank r of a prefiller pushes its shard to rank r of the decoder, which
    binds kv_port + r; the proxy only knows the rank-0 endpoint."""
    assert rank_endpoint("tcp://127.0.0.1:9100", 0) == "tcp://127.0.0.1:9100"
    assert rank_endpoint("tcp://127.0.0.1:9100", 3) == "tcp://127.0.0.1:9103"
    assert rank_endpoint("tcp://[::1]:9100", 1) == "tcp://[::1]:9101"
    with pytest.raises(ConfigError, match="no port"):
        rank_endpoint("tcp://host-without-port", 1)
    with pytest.raises(ConfigError):
        rank_endpoint("tcp://127.0.0.1:65535", 1)


@pytest.mark.parametrize(
    "plan_tokens",
    [
        [t + 1 for t in tokens(150)],  # another tokenizer or chat template: foreign keys
        tokens(150)[:100] + [0] * 50,  # the same first chunk, then not
    ],
)
def test_a_decoder_refuses_a_transfer_whose_keys_are_not_its_prompts(
    pair: tuple[FabricWorker, FabricWorker], plan_tokens: list[int]
) -> None:
    p, d = pair
    assert d.node is not None
    src = [7, 8, 9, 10, 30, 31, 1, 2, 3, 4]
    push(p, d.node.endpoint, 150, src)
    d.start_load(
        FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, list(range(10)), 150, plan_tokens)])
    )
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    counts = d.counters.take()
    assert counts["refused_transfers"] == 1 and "chunks_loaded" not in counts
    assert d.store.reserved_count() == 0
    # the next request is served normally
    assert_the_next_push_loads(p, d, "t9")


def test_a_truncated_reserve_under_the_transfer_id_is_refused(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    p, d = pair
    assert d.node is not None
    push(p, d.node.endpoint, 100, [7, 8, 9, 10, 30, 31, 1])  # 2 of the prompt's 3 chunks
    plan = LoadPlan("d-req", "t1", 0, list(range(10)), 150, tokens(150))
    d.start_load(FabricMetadata(loads=[plan]))
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    assert d.counters.take()["refused_transfers"] == 1


def test_an_exception_in_the_load_thread_fails_that_load_only(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric.integrations.vllm import loader as loader_module

    p, d = pair
    assert d.node is not None and d.loader is not None
    real_unpack, calls = loader_module.unpack, []

    def unpack_failing_once(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        real_unpack(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader_module, "unpack", unpack_failing_once)
    push(p, d.node.endpoint, 64, [3, 4, 5, 6])
    d.start_load(FabricMetadata(loads=[LoadPlan("d1", "t1", 0, [10, 11, 12, 13], 64, tokens(64))]))
    assert wait_results(d) == ({"d1"}, {"d1"})
    assert d.counters.take()["thread_errors"] == 1
    assert_the_next_push_loads(p, d, "t3")
    assert d.loader._thread.is_alive()


def test_an_exception_in_the_pack_thread_fails_that_push_only(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric.integrations.vllm import worker as worker_module

    p, d = pair
    assert d.node is not None
    calls: list[int] = []

    def failing_once(real: Callable[..., Any]) -> Callable[..., Any]:
        def pack_failing_once(*args: object, **kwargs: object) -> Any:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected")
            return real(*args, **kwargs)

        return pack_failing_once

    # NOTE: one pack thread packs with pack_checksummed, more with pack
    for name in ("pack", "pack_checksummed"):
        monkeypatch.setattr(worker_module, name, failing_once(getattr(worker_module, name)))
    push(p, d.node.endpoint, 150, [7, 8, 9, 10, 30, 31, 1, 2, 3, 4])
    p.before_step()
    d.start_load(FabricMetadata(loads=[LoadPlan("d1", "t1", 0, list(range(10)), 150, tokens(150))]))
    assert wait_results(d) == ({"d1"}, {"d1"})
    assert p.counters.take()["thread_errors"] == 1
    assert p.store.stats().reserved == 0  # the slot it was packing into went back
    assert_the_next_push_loads(p, d, "t3")


def test_an_exception_in_the_push_thread_fails_that_push_only(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric.integrations.vllm.sender import PushJob, PushSender

    p, d = pair
    assert d.node is not None and p.sender is not None
    real_write, calls = PushSender._write, []

    def write_failing_once(self: PushSender, job: PushJob, index: int, slot: int) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        real_write(self, job, index, slot)

    monkeypatch.setattr(PushSender, "_write", write_failing_once)
    push(p, d.node.endpoint, 64, [3, 4, 5, 6])
    d.start_load(FabricMetadata(loads=[LoadPlan("d1", "t1", 0, [10, 11, 12, 13], 64, tokens(64))]))
    assert wait_results(d) == ({"d1"}, {"d1"})
    assert p.counters.take()["thread_errors"] == 1
    assert_the_next_push_loads(p, d, "t3")
    assert p.sender._thread.is_alive()
    p.flush()
    assert p.store.stats().reserved == 0


def test_a_chunk_corrupted_after_it_verified_is_caught_at_use(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    p, d = pair
    assert d.node is not None and d.node.server is not None
    push(p, d.node.endpoint, 64, [3, 4, 5, 6])
    deadline = time.monotonic() + 10
    while not ((prog := d.node.server.progress("t1")) and 0 in prog.filled):
        assert time.monotonic() < deadline, "the chunk never landed"
        time.sleep(0.01)
    res = d.store.reservation("t1")
    assert res is not None
    d.store.pool.slot_view(res.slots[0]).view(torch.uint8)[100] ^= 0xFF  # a late write
    d.start_load(FabricMetadata(loads=[LoadPlan("d1", "t1", 0, [10, 11, 12, 13], 64, tokens(64))]))
    assert wait_results(d) == ({"d1"}, {"d1"})
    assert d.counters.take()["corrupt_chunks"] == 1


def test_table_gauges_are_named_after_the_global_rank() -> None:
    """Two workers of one engine (TP or PP ranks) never share a gauge source."""
    config = ConnectorConfig.from_extra({"transport": "loopback", "chunk_tokens": CT})
    w = FabricWorker(config, produce=True, consume=False, block_size=BS, model="tiny", rank=3)
    w.report_tables()
    assert set(w.counters.take()[TABLES_KEY]) == {"worker3"}
    plain = FabricWorker(config, produce=True, consume=False, block_size=BS, model="tiny")
    plain.report_tables()
    assert set(plain.counters.take()[TABLES_KEY]) == {"worker0"}  # tp_rank without a rank


def test_an_idle_engines_receiver_wakes_a_few_times_a_second_not_hundreds() -> None:
    """Nothing outstanding: the receiver's loop sleeps until a control
    message comes (at most ENGINE_IDLE_POLL_MS), on an engine that has one
    core for vLLM's forward pass and fabric's threads. A count, not a time:
    a busy box only makes the loop wake less."""
    d = worker(produce=False, consume=True, seed=1)
    try:
        assert d.node is not None and d.node.server is not None
        server = d.node.server
        steps = loop_wakeups(server)
        assert 0 < steps <= 1000 / ENGINE_IDLE_POLL_MS + 10  # 5 ms polls: ~200
    finally:
        d.shutdown()


def test_vram_pools_push_and_load_with_fold64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both engines' pools in "VRAM" (host memory posing as cuda:0, the CPU
    caches unchanged): P's chunks are committed under fold64 (not the xxh3
    its fused pack computes), the Hello agrees, D verifies every chunk with
    fold64 on landing and again at unpack, and the blocks equal P's."""
    staged = host_backed_vram(monkeypatch)
    monkeypatch.setattr(FabricWorker, "_pool_device", lambda self: "cuda:0")
    p = worker(produce=True, consume=False, seed=1)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=3)
    try:
        assert d.node is not None and d.node.server is not None
        assert (p.store.pool.checksum_name, d.store.pool.checksum_name) == ("fold64", "fold64")
        assert p.layered is None, "layer groups are hashed with xxh3: host pools only"
        num_tokens = 150
        src = [7, 8, 9, 10, 30, 31, 1, 2, 3, 4]
        push(p, d.node.endpoint, num_tokens, src)
        dst = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
        d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, dst, 150, tokens(150))]))
        assert wait_results(d) == ({"d-req"}, set())
        for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
            for b in range(len(src)):
                assert torch.equal(d_layer[dst[b]], p_layer[src[b]]), b
        assert d.node.server.stats.checksum_failures == 0 and staged == []
        for slot in range(p.store.pool.num_slots):
            value, nbytes = p.store.slot_checksum(slot), p.store.slot_nbytes(slot)
            if value is not None:
                data = bytes(p.store.pool.slot_view(slot)[:nbytes].tolist())
                assert value == fold64_reference(data) != checksum(data)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device")
@pytest.mark.parametrize(
    ("pool_device", "message"),
    [
        ("pinned", "pool_device: device: 'pinned' needs a CUDA device"),
        ("cuda", "kv_connector_extra_config.pool_device: 'cuda' with the loopback transport"),
    ],
)
def test_a_pool_device_that_cannot_be_had_fails_at_start(pool_device: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        worker(produce=True, consume=False, seed=1, pool_device=pool_device)
