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
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.metadata import Claim, FabricMetadata, LoadPlan, PackChunk, SendPlan
from fabric.integrations.vllm.worker import FabricWorker
from fabric.kv.spans import chunk_block_counts
from fabric.transfer import server as server_module

from . import test_vllm_tables
from .test_vllm_early_load import DST, SRC, load, push, results_now
from .test_vllm_scheduler import Out, Req
from .test_vllm_scheduler_liveness import scheduler_connector
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
    assert d.store.stats().expired_reservations == 0  # NOTE: released, not run out
    push(p, d.node.endpoint, "t-never")
    while not server.snapshot()["server_reserves_late"]:
        assert time.monotonic() < deadline, "the late Reserve was not refused"
        time.sleep(0.01)
    assert server.table_sizes()["store_leases"] == 0


def test_a_claim_is_kept_no_longer_than_waiting_hold_s() -> None:
    """A hold of 2.5 leases: the transfer outlives its lease while the claim
    holds, then runs out once the hold ended (not released: the request may
    still come, and load what is left)."""
    p, d = leased_pair(LEASE_MS, unknown_transfer_grace_s=0.3, waiting_hold_s=2.5)
    try:
        assert d.node is not None and d.node.server is not None
        claim(d, "t-old")
        push(p, d.node.endpoint, "t-old")
        wait_pushed(d, "t-old")
        claimed_at = time.monotonic()
        step_idle(d, 2.0)  # NOTE: past the 1 s lease
        assert d.node.server.table_sizes()["store_leases"] == 1
        deadline = time.monotonic() + 10
        while d.node.server.table_sizes()["store_leases"]:
            assert time.monotonic() < deadline, "the claim held the transfer past its bound"
            time.sleep(0.05)
        assert time.monotonic() - claimed_at >= 2.0
        assert d.counters.take()["claims_expired"] == 1
        assert d.table_sizes()["loader_claims"] == 0
        assert d.store.stats().expired_reservations == 1
    finally:
        p.shutdown()
        d.shutdown()


def test_a_claim_does_not_keep_a_push_that_never_completes(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """A Reserve, then no chunk and no heartbeat (its prefiller died
    mid-prefill): the claim keeps only complete pushes, so the reservation
    runs out with its lease, as without a claim."""
    p, d = pair
    assert d.node is not None and d.node.server is not None
    claim(d, "t-dead")
    assert p.sender is not None
    link = p.sender.client.connect(d.node.endpoint)
    nbytes = d.store.pool.slot_bytes
    link.reserve("t-dead", [bytes([i]) * 16 for i in range(3)], [nbytes] * 3, LEASE_MS)
    assert d.node.server.progress("t-dead") is not None
    deadline = time.monotonic() + 10
    while d.node.server.table_sizes()["store_leases"]:
        assert time.monotonic() < deadline, "the claim kept an incomplete push alive"
        time.sleep(0.05)
    assert d.table_sizes()["loader_claims"] == 1  # NOTE: the request still waits


def test_a_claimed_request_allocated_without_a_load_releases_its_transfer(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """vLLM allocated it but loads nothing (refused params, a full local
    hit): the scheduler ships an unclaim, and the transfer goes at once,
    released rather than held until the request ends."""
    p, d = pair
    assert d.node is not None and d.node.server is not None
    claim(d, "t-unused")
    push(p, d.node.endpoint, "t-unused")
    wait_pushed(d, "t-unused")
    d.start_load(FabricMetadata(unclaims=["d-req"]))
    deadline = time.monotonic() + 10
    while d.node.server.table_sizes()["store_leases"] or d.table_sizes()["loader_claims"]:
        assert time.monotonic() < deadline, "the unclaimed transfer is still held"
        time.sleep(0.01)
    assert d.store.stats().expired_reservations == 0


def test_a_claim_and_its_load_in_one_step_load(pair: tuple[FabricWorker, FabricWorker]) -> None:
    """A request scheduled in the step after its arrival: both come in one
    metadata (claims first); the load takes the transfer over."""
    p, d = pair
    assert d.node is not None
    push(p, d.node.endpoint, "t-now")
    plan = LoadPlan("d-req", "t-now", 0, DST, 150, tokens(150))
    d.start_load(FabricMetadata(claims=[Claim("d-req", "t-now")], loads=[plan]))
    assert wait_results(d) == ({"d-req"}, set())
    assert d.table_sizes()["loader_claims"] == 0


def test_vllm_calls_on_new_request_for_each_request_it_queues() -> None:
    """The contract claims rest on (vLLM 0.32): ``Scheduler.add_request``
    calls the connector's ``on_new_request`` for a new request, and the
    FabricConnector overrides the base's no-op."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.scheduler import Scheduler

    from fabric.integrations.vllm.connector import FabricConnector

    assert "self.connector.on_new_request(request)" in inspect.getsource(Scheduler.add_request)
    assert FabricConnector.on_new_request is not KVConnectorBase_V1.on_new_request


def test_the_scheduler_claims_a_decoders_transfer_on_arrival(tmp_path: Path) -> None:
    """Through the connector's hook: the claim rides the next metadata; a
    request that ends before that step ships none; one without a remote
    prefill claims nothing; a claimed request allocated without a load
    ships an unclaim, one that loads does not."""
    c = scheduler_connector(tmp_path)
    remote = {"do_remote_prefill": True, "transfer_id": "t1"}
    c.on_new_request(Req("r1", tokens(150), remote))
    c.on_new_request(Req("r2", tokens(150), remote | {"transfer_id": "t2"}))
    c.on_new_request(Req("r3", tokens(150), None))
    c.request_finished(Req("r2", tokens(150), remote), [])
    assert c._scheduler.table_sizes()["scheduler_claims"] == 1
    meta = c.build_connector_meta(Out())
    assert (meta.claims, meta.unclaims) == ([Claim("r1", "t1")], [])
    assert c.build_connector_meta(Out()).claims == []
    refused = Req("r4", tokens(150), remote | {"transfer_id": "t4", "num_tokens": 99})
    c.on_new_request(refused)
    assert c.get_num_new_matched_tokens(refused, 0) == (0, False)  # NOTE: P pushed 99 tokens
    c.update_state_after_alloc(refused, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    blocks = SimpleNamespace(get_block_ids=lambda: ([*range(10)],))
    loading = Req("r1", tokens(150), remote)
    assert c.get_num_new_matched_tokens(loading, 0) == (150, True)
    c.update_state_after_alloc(loading, blocks, 150)
    meta = c.build_connector_meta(Out())
    assert meta.claims == [Claim("r4", "t4")] and meta.unclaims == ["r4"]
    assert [plan.req_id for plan in meta.loads] == ["r1"]


def test_waiting_hold_s_must_be_positive() -> None:
    from fabric.errors import ConfigError

    with pytest.raises(ConfigError, match="waiting_hold_s"):
        ConnectorConfig.from_extra({"waiting_hold_s": 0})


@pytest.mark.parametrize("planned", ["before", "after"])
def test_a_load_whose_push_this_store_refused_fails_at_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, planned: str
) -> None:
    """D's store (3 slots) is full of a claimed transfer whose request still
    waits; the next push is refused for capacity. Its load fails at once (no
    sender retries a refused push): one already waiting (grace 60 s), and
    one planned after the server forgot the refusal (its request waited in
    the queue past ``REFUSED_LINGER_S``; the claim kept the refusal). The
    old loader waited out its grace holding the request's blocks."""
    p, d = leased_pair(LEASE_MS, store_slots=3, load_timeout_s=60, unknown_transfer_grace_s=60)
    try:
        assert d.node is not None and d.node.server is not None
        server = d.node.server
        claim(d, "t-first", rid="r-first")
        push(p, d.node.endpoint, "t-first")  # NOTE: 3 chunks: every slot
        wait_pushed(d, "t-first")
        other = list(range(1000, 1150))
        plan = LoadPlan("d-req", "t-full", 0, DST, 150, other)
        claims = [Claim("d-req", "t-full")]
        d.start_load(FabricMetadata(claims=claims, loads=[plan] if planned == "before" else []))
        caplog.set_level(logging.WARNING)
        counts = chunk_block_counts(150, 64, 16)
        packs, start = [], 0
        for index, n in enumerate(counts):
            packs.append(PackChunk("p-full", index, SRC[start : start + n]))
            start += n
        sends = [SendPlan("p-full", "t-full", d.node.endpoint, other, counts)]
        p.pack_step(FabricMetadata(sends=sends, packs=packs))
        if planned == "after":
            deadline = time.monotonic() + 10
            while server.refusal("t-full") is None:
                assert time.monotonic() < deadline, "the push was never refused"
                time.sleep(0.01)
            step_idle(d, 2.0)  # NOTE: the claim looks at least once a second
            monkeypatch.setattr(server_module, "REFUSED_LINGER_S", 0.0)
            while server.table_sizes()["server_refusals"]:
                assert time.monotonic() < deadline + 10, "the refusal is never forgotten"
                time.sleep(0.05)
            d.start_load(FabricMetadata(loads=[plan]))
        assert wait_results(d, timeout=5) == ({"d-req"}, {"d-req"})
        assert "the push of t-full was refused here: capacity" in caplog.text
        assert server.refusal("t-full") is None  # NOTE: its load released it
        assert server.table_sizes()["server_refusals"] == 0
        assert d.table_sizes()["loader_claims"] == 1  # r-first still waits
    finally:
        p.shutdown()
        d.shutdown()
