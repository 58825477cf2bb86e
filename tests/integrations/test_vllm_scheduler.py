"""Scheduler-side logic of the FabricConnector, with vLLM's data shapes faked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from fabric.errors import ConfigError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.scheduler import FabricScheduler
from fabric.kv.spans import chunk_block_counts

BS = 16  # vLLM block size
CT = 64  # chunk tokens: 4 blocks per chunk


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Out:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        # NOTE: vLLM's SchedulerOutput carries the sum (vllm/v1/core/sched/output.py)
        return sum(self.num_scheduled_tokens.values())


def sched(**kw: Any) -> FabricScheduler:
    return FabricScheduler(ConnectorConfig(chunk_tokens=CT), BS, **kw)


def prefill_req(n: int) -> Req:
    params = {"do_remote_decode": True, "transfer_id": "t1", "decode_kv_endpoint": "tcp://x:1"}
    return Req("r1", list(range(n)), params)


def test_chunk_block_counts() -> None:
    assert chunk_block_counts(64, 64, 16) == [4]
    assert chunk_block_counts(65, 64, 16) == [4, 1]
    assert chunk_block_counts(100, 64, 16) == [4, 3]
    assert chunk_block_counts(5, 64, 16) == [1]


def test_chunk_tokens_must_be_a_multiple_of_the_block_size() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        FabricScheduler(ConnectorConfig(chunk_tokens=100), 16, produce=True, consume=False)


def test_prefiller_saves_chunks_as_steps_complete_them() -> None:
    s = sched(produce=True, consume=False)
    req = prefill_req(150)  # chunks: 64, 64, 22 tokens -> 4, 4, 2 blocks
    s.update_state_after_alloc(req, [], 0)
    blocks = list(range(100, 110))
    # step 1 computes 100 tokens: only chunk 0 is complete
    meta = s.build_connector_meta(Out([NewReq("r1", (blocks[:7],), 0)], Cached(), {"r1": 100}))
    assert [p.transfer_id for p in meta.sends] == ["t1"]
    assert meta.sends[0].chunk_blocks == [4, 4, 2]
    assert [(c.index, c.block_ids) for c in meta.packs] == [(0, blocks[:4])]
    # step 2 computes the remaining 50: chunks 1 and 2 (partial)
    cached = Cached(["r1"], set(), [(blocks[7:],)], [100])
    meta = s.build_connector_meta(Out([], cached, {"r1": 50}))
    assert meta.sends == []
    assert [(c.index, c.block_ids) for c in meta.packs] == [(1, blocks[4:8]), (2, blocks[8:10])]
    hold, params = s.request_finished(req)
    assert not hold  # NOTE: packed and pushed: vLLM frees the blocks at once
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "t1",
        "num_tokens": 150,
        "chunk_tokens": CT,
    }


def test_direct_reads_hold_an_announced_pushs_blocks_and_only_those() -> None:
    """vLLM keeps a finished request's blocks only while ``request_finished``
    says so; a worker reports each held request sent exactly once, so the
    scheduler holds exactly the pushes it announced (SendPlan.hold)."""
    s = FabricScheduler(
        ConnectorConfig(chunk_tokens=CT, direct_reads=True), BS, produce=True, consume=False
    )
    req = prefill_req(100)
    s.update_state_after_alloc(req, [], 0)
    meta = s.build_connector_meta(Out([NewReq("r1", (list(range(7)),), 0)], Cached(), {"r1": 100}))
    assert [p.hold for p in meta.sends] == [True]
    hold, params = s.request_finished(req)
    assert hold and params is not None and params["transfer_id"] == "t1"
    # never scheduled (aborted while waiting): no SendPlan reached a worker, no hold
    waiting = Req("r2", list(range(100)), dict(prefill_req(1).kv_transfer_params or {}))
    s.update_state_after_alloc(waiting, [], 0)
    assert s.request_finished(waiting) == (False, None)
    # finished before its last chunk was computed: still held (the worker saw it)
    early = Req("r3", list(range(200)), dict(prefill_req(1).kv_transfer_params or {}))
    s.update_state_after_alloc(early, [], 0)
    s.build_connector_meta(Out([NewReq("r3", (list(range(13)),), 0)], Cached(), {"r3": 64}))
    assert s.request_finished(early) == (True, None)
    # a save-only request (no decoder) is never held
    keep = Req("r4", list(range(128)))
    tiered = FabricScheduler(
        ConnectorConfig(chunk_tokens=CT, direct_reads=True), BS, produce=True, consume=False
    )
    tiered.update_state_after_alloc(keep, [], 0)
    assert tiered.request_finished(keep) == (False, None)


def test_preempted_prefill_continues_with_new_blocks() -> None:
    s = sched(produce=True, consume=False)
    req = prefill_req(128)
    s.update_state_after_alloc(req, [], 0)
    meta = s.build_connector_meta(Out([NewReq("r1", ([1, 2, 3, 4, 5],), 0)], Cached(), {"r1": 64}))
    assert [c.index for c in meta.packs] == [0]
    resumed = Cached(["r1"], {"r1"}, [([9, 8, 7, 6, 5, 4, 3, 2],)], [0])
    meta = s.build_connector_meta(Out([], resumed, {"r1": 128}))
    assert [(c.index, c.block_ids) for c in meta.packs] == [(1, [5, 4, 3, 2])]


def test_unfinished_push_returns_no_params() -> None:
    s = sched(produce=True, consume=False)
    req = prefill_req(200)
    s.update_state_after_alloc(req, [], 0)
    s.build_connector_meta(Out([NewReq("r1", (list(range(13)),), 0)], Cached(), {"r1": 64}))
    assert s.request_finished(req) == (False, None)


def test_prefill_without_endpoint_pushes_nothing() -> None:
    s = sched(produce=True, consume=False)
    req = Req("r1", list(range(10)), {"do_remote_decode": True})
    s.update_state_after_alloc(req, [], 0)
    meta = s.build_connector_meta(Out([NewReq("r1", ([1],), 0)], Cached(), {"r1": 10}))
    assert meta.sends == [] and meta.packs == []


def decode_req(n: int, **params: Any) -> Req:
    base = {"do_remote_prefill": True, "transfer_id": "t9", "num_tokens": n}
    return Req("d1", list(range(n)), base | params)


def test_decoder_loads_everything_beyond_the_local_prefix() -> None:
    s = sched(produce=False, consume=True)
    req = decode_req(150)
    assert s.get_num_new_matched_tokens(req, 32) == (118, True)
    blocks = list(range(50, 60))
    s.update_state_after_alloc(req, blocks, 118)
    meta = s.build_connector_meta(Out())
    (plan,) = meta.loads
    assert (plan.req_id, plan.transfer_id, plan.first_block, plan.num_tokens) == (
        "d1",
        "t9",
        2,
        150,
    )
    assert plan.block_ids == blocks[2:10]
    assert s.build_connector_meta(Out()).loads == []  # handed over once


@pytest.mark.parametrize(
    "params",
    [
        {"num_tokens": 99},  # P saw another prompt
        {"transfer_id": None},
    ],
)
def test_decoder_computes_locally_when_params_do_not_fit(params: dict[str, Any]) -> None:
    s = sched(produce=False, consume=True)
    assert s.get_num_new_matched_tokens(decode_req(150, **params), 0) == (0, False)


def test_producer_only_engine_ignores_remote_prefill() -> None:
    s = sched(produce=True, consume=False)
    assert s.get_num_new_matched_tokens(decode_req(150), 0) == (0, False)


def test_config_from_extra_names_bad_fields() -> None:
    assert ConnectorConfig.from_extra({"kv_port": "5600"}).kv_port == 5600
    with pytest.raises(ConfigError, match="unknown key"):
        ConnectorConfig.from_extra({"kv_prot": 1})
    with pytest.raises(ConfigError, match="chunk_tokens"):
        ConnectorConfig.from_extra({"chunk_tokens": 0})
    with pytest.raises(ConfigError, match="load_timeout_s"):
        ConnectorConfig.from_extra({"load_timeout_s": "soon"})
    with pytest.raises(ConfigError, match="lookup_deadline_ms: 100 is below lookup_timeout_ms 200"):
        ConnectorConfig.from_extra({"lookup_timeout_ms": 200, "lookup_deadline_ms": 100})
    assert ConnectorConfig.from_extra({"lookup_deadline_ms": "5000"}).lookup_deadline_ms == 5000
    assert ConnectorConfig.from_extra({}).pool_device == "auto"
    with pytest.raises(ConfigError, match="pool_device"):
        ConnectorConfig.from_extra({"pool_device": "vram"})
    with pytest.raises(ConfigError, match="pool_device: 'cuda' with the tcp transport"):
        ConnectorConfig.from_extra({"pool_device": "cuda", "transport": "tcp"})
    with pytest.raises(ConfigError, match="pool_device: 'cuda' with a shared_store"):
        ConnectorConfig.from_extra({"pool_device": "cuda", "shared_store": "127.0.0.1:1"})
    wild = ConnectorConfig.from_extra(
        {"host": "0.0.0.0", "advertise_host": "10.0.0.9", "secret": "s"}
    )
    assert wild.advertise_host == "10.0.0.9"
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.advertise_host"):
        ConnectorConfig.from_extra({"host": "0.0.0.0", "advertise_host": "0.0.0.0", "secret": "s"})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.host.*IPv6"):
        ConnectorConfig.from_extra({"host": "::"})


def test_decoder_tries_a_load_once_then_computes() -> None:
    s = sched(produce=False, consume=True)
    req = decode_req(150)
    assert s.get_num_new_matched_tokens(req, 0) == (150, True)
    s.update_state_after_alloc(req, list(range(10)), 150)
    assert len(s.build_connector_meta(Out()).loads) == 1
    # the load failed: vLLM reschedules the request and asks again
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.request_finished(req)
    assert s.get_num_new_matched_tokens(req, 0) == (150, True)  # a new request, same id
