"""A request that waits in vLLM's queue keeps what was pushed for it.

Sequential flow under KV pressure (the 200-request e2e run): P pushes as
soon as it computed, D queues the request until its pool has blocks, often
longer than the push's lease. Before claims the transfer expired while the
request waited, and its load, begun at allocation, found nothing ("no
transfer reached this engine": 132 of 140 loads in that run). A producing
and a consuming worker over the loopback data plane, leases of 1 s, in
vLLM's order: the claim comes in the metadata of the step after
``add_request`` (``on_new_request``), the LoadPlan steps later, at
allocation; a request aborted while it waits is named in
``finished_req_ids``.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.metadata import Claim, FabricMetadata, LoadPlan, SaveChunk, SendPlan
from fabric.integrations.vllm.scheduler import FabricScheduler, chunk_block_counts
from fabric.integrations.vllm.worker import FabricWorker

from . import test_vllm_tables
from .test_vllm_early_load import DST, SRC, load, push, results_now
from .test_vllm_worker import leased_pair, tokens, wait_results

LEASE_MS = test_vllm_tables.LEASE_MS
WAIT_S = 3 * LEASE_MS / 1000  # the request waits for blocks this long


def claim(d: FabricWorker, tid: str, rid: str = "d-req") -> None:
    d.start_load(FabricMetadata(claims=[Claim(rid, tid)]))


def wait_pushed(d: FabricWorker, tid: str) -> None:
    server = d.node.server if d.node is not None else None
    assert server is not None
    deadline = time.monotonic() + 10
    while (prog := server.progress(tid)) is None or not prog.complete:
        assert time.monotonic() < deadline, "the push never completed"
        time.sleep(0.01)


def step_idle(d: FabricWorker, seconds: float) -> None:
    """vLLM's steps while the request waits: nothing for it in them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert results_now(d) == (set(), set())
        time.sleep(0.1)


pair = test_vllm_tables.pair  # NOTE: the fixture: a producer and a consumer, leases of 1 s


@pytest.mark.parametrize("claimed", [True, False])
def test_a_transfer_pushed_while_its_request_waits_past_the_lease_is_loaded(
    pair: tuple[FabricWorker, FabricWorker], claimed: bool
) -> None:
    """Claimed (today's scheduler sends the claim): loaded. Not claimed (the
    old scheduler sent none): the lease ran out while the request waited,
    and the load fails, as every such load did before."""
    p, d = pair
    assert d.node is not None
    if claimed:
        claim(d, "t-wait")  # NOTE: on arrival, before P pushed
    push(p, d.node.endpoint, "t-wait")
    wait_pushed(d, "t-wait")
    step_idle(d, WAIT_S)
    load(d, "t-wait")
    finished, failed = wait_results(d)
    assert finished == {"d-req"}
    if not claimed:
        assert failed == {"d-req"}
        return
    assert failed == set()
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for s, t in zip(SRC, DST, strict=True):
            assert torch.equal(d_layer[t], p_layer[s])
    counts = d.counters.take()
    assert counts["loads_ok"] == 1 and not counts.get("claims_expired"), counts
    assert d.table_sizes()["loader_claims"] == 0


def test_a_claim_made_before_the_push_keeps_it_too(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """The claim comes first, the push lands a while later (P still
    computing), the request waits on past the push's lease: loaded."""
    p, d = pair
    assert d.node is not None
    claim(d, "t-later")
    step_idle(d, 0.5)
    push(p, d.node.endpoint, "t-later")
    wait_pushed(d, "t-later")
    step_idle(d, WAIT_S)
    load(d, "t-later")
    assert wait_results(d) == ({"d-req"}, set())


def test_a_request_that_ends_while_it_waits_lets_its_transfer_go(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """Aborted before it got blocks: its pushed slots are released at once
    (not held for the lease), and a transfer claimed but never pushed is
    refused when its Reserve comes after the end."""
    p, d = pair
    assert d.node is not None and d.node.server is not None
    server = d.node.server
    claim(d, "t-abort", rid="r-pushed")
    claim(d, "t-never", rid="r-late")
    push(p, d.node.endpoint, "t-abort")
    wait_pushed(d, "t-abort")
    assert d.get_results({"r-pushed", "r-late"}) == (set(), set())
    deadline = time.monotonic() + 10
    while server.table_sizes()["store_leases"] or d.table_sizes()["loader_claims"]:
        assert time.monotonic() < deadline, (server.table_sizes(), d.table_sizes())
        time.sleep(0.01)
    assert server.table_sizes()["store_referenced_slots"] == 0
    push(p, d.node.endpoint, "t-never")
    while not server.snapshot()["server_reserves_late"]:
        assert time.monotonic() < deadline, "the late Reserve was not refused"
        time.sleep(0.01)
    assert server.table_sizes()["store_leases"] == 0


def test_a_claim_is_kept_no_longer_than_waiting_hold_s() -> None:
    p, d = leased_pair(LEASE_MS, unknown_transfer_grace_s=0.3, waiting_hold_s=0.5)
    try:
        assert d.node is not None and d.node.server is not None
        claim(d, "t-old")
        push(p, d.node.endpoint, "t-old")
        wait_pushed(d, "t-old")
        deadline = time.monotonic() + 10
        while d.node.server.table_sizes()["store_leases"]:
            assert time.monotonic() < deadline, "the claim held the transfer past its bound"
            time.sleep(0.05)
        assert d.counters.take()["claims_expired"] == 1
        assert d.table_sizes()["loader_claims"] == 0
    finally:
        p.shutdown()
        d.shutdown()


def request(rid: str, params: dict[str, object] | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens(150), kv_transfer_params=params)


def test_the_scheduler_claims_a_decoders_transfer_on_arrival() -> None:
    """vLLM calls ``on_new_request`` in ``add_request``; the claim rides the
    next metadata; a request that ends before that step ships none; a
    prefiller, or a request without a remote prefill, claims nothing."""
    config = ConnectorConfig.from_extra({"chunk_tokens": 64})
    sched = FabricScheduler(config, 16, produce=False, consume=True)
    remote = {"do_remote_prefill": True, "transfer_id": "t1"}
    sched.on_new_request(request("r1", remote))
    sched.on_new_request(request("r2", remote | {"transfer_id": "t2"}))
    sched.on_new_request(request("r3", None))
    sched.request_finished(request("r2", remote))
    assert sched.table_sizes()["scheduler_claims"] == 1
    out = SimpleNamespace(
        total_num_scheduled_tokens=0,
        num_scheduled_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )
    assert sched.build_connector_meta(out).claims == [Claim("r1", "t1")]
    assert sched.build_connector_meta(out).claims == []
    producer = FabricScheduler(config, 16, produce=True, consume=False)
    producer.on_new_request(request("r1", remote))
    assert producer.build_connector_meta(out).claims == []


def test_waiting_hold_s_must_be_positive() -> None:
    from fabric.errors import ConfigError

    with pytest.raises(ConfigError, match="waiting_hold_s"):
        ConnectorConfig.from_extra({"waiting_hold_s": 0})


def test_a_load_whose_push_this_store_refused_fails_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """D's store (3 slots) is full of a claimed transfer whose request still
    waits; the next push is refused for capacity. Its load, already waiting
    (grace 60 s), fails at once: no sender retries a refused push. The old
    loader waited out its grace holding the request's blocks."""
    p, d = leased_pair(LEASE_MS, store_slots=3, load_timeout_s=60, unknown_transfer_grace_s=60)
    try:
        assert d.node is not None and d.node.server is not None
        claim(d, "t-first", rid="r-first")
        push(p, d.node.endpoint, "t-first")  # NOTE: 3 chunks: every slot
        wait_pushed(d, "t-first")
        other = list(range(1000, 1150))
        plan = LoadPlan("d-req", "t-full", 0, DST, 150, other)
        d.start_load(FabricMetadata(claims=[Claim("d-req", "t-full")], loads=[plan]))
        caplog.set_level(logging.WARNING)
        counts = chunk_block_counts(150, 64, 16)
        saves, start = [], 0
        for index, n in enumerate(counts):
            saves.append(SaveChunk("p-full", index, SRC[start : start + n]))
            start += n
        sends = [SendPlan("p-full", "t-full", d.node.endpoint, other, counts)]
        p.save(FabricMetadata(sends=sends, saves=saves))
        assert wait_results(d, timeout=5) == ({"d-req"}, {"d-req"})
        assert "the push of t-full was refused here: capacity" in caplog.text
        assert d.node.server.refusal("t-full") is None  # NOTE: its load released it
        assert d.node.server.table_sizes()["server_refusals"] == 0
    finally:
        p.shutdown()
        d.shutdown()
