"""The engine's scheduler never waits on the network for long.

Reuse-tier lookups against real ZMQ ROUTER sockets standing in for TP
ranks (one answers, one reads and never answers, one is not there); the
shared store's fetch on the same terms; the scheduler hold observed once
per step; the scheduler's per-request tables empty once every request has
ended, however it ended.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import TABLES_KEY, FabricCounters
from fabric.integrations.vllm.scheduler import FabricScheduler
from fabric.integrations.vllm.tier_client import MAX_TIMEOUTS, SharedTierClient, WorkerTierClient
from fabric.integrations.vllm.worker import endpoint_file
from fabric.kv.identity import KeyIdentity
from fabric.launch.process import free_port
from fabric.transfer.lookup import write_endpoint
from tests.integrations.test_vllm_reuse_scheduler import FakeTier
from tests.integrations.test_vllm_scheduler import BS, CT, Cached, NewReq, Out, Req
from tests.integrations.test_vllm_shared_store import FakeShared
from tests.transfer.test_lookup import FakeRank

TOKENS = list(range(4 * CT))
BOUND_MS = 200


@pytest.fixture
def ranks() -> Iterator[Callable[..., FakeRank]]:
    started: list[FakeRank] = []

    def start(hit: int | None, **kw: Any) -> FakeRank:
        started.append(FakeRank(hit, **kw))
        return started[-1]

    yield start
    for rank in started:
        rank.close()


@pytest.fixture
def engine() -> Iterator[Callable[[list[str]], str]]:
    """An engine id whose TP ranks' endpoint files name the given endpoints."""
    written: list[Path] = []

    def make(endpoints: list[str]) -> str:
        engine_id = f"liveness-{uuid.uuid4().hex[:8]}"
        for rank, endpoint in enumerate(endpoints):
            path = endpoint_file(engine_id, rank)
            write_endpoint(path, endpoint)
            written.append(path)
        return engine_id

    yield make
    for path in written:
        path.unlink(missing_ok=True)


def tier(
    engine_id: str, tp_size: int, *, backoff_s: float = 10.0, **extra: Any
) -> WorkerTierClient:
    config = ConnectorConfig(chunk_tokens=CT, lookup_timeout_ms=BOUND_MS, **extra)
    return WorkerTierClient(config, tp_size=tp_size, engine_id=engine_id, backoff_s=backoff_s)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# ---------------------------------------------------------------- reuse tier
def test_tp_ranks_are_asked_in_parallel(ranks, engine) -> None:
    """Rank 0 answers only once rank 1 got its request: asked one after the
    other (rank 1 after rank 0's answer), rank 0 would time out."""
    rank1_asked = threading.Event()
    rank0 = ranks(3, before_answer=lambda: rank1_asked.wait(30))
    rank1 = ranks(2, on_request=rank1_asked.set)
    client = tier(engine([rank0.endpoint, rank1.endpoint]), 2)
    try:
        assert client.lookup("r1", TOKENS) == 2  # the smaller hit wins
        assert client.counters.take() == {}
    finally:
        client.close()


def test_one_late_rank_is_a_miss_for_that_request_not_a_blackout(ranks, engine) -> None:
    answering, stalled = ranks(3), ranks(None)
    client = tier(engine([answering.endpoint, stalled.endpoint]), 2)
    try:
        started = time.monotonic()
        assert client.lookup("r1", TOKENS) == 0  # a miss: vLLM computes r1
        assert time.monotonic() - started >= BOUND_MS / 1000  # it waited for the bound
        assert client.counters.take() == {"lookup_timeouts": 1}
        assert not client.backoff.skipping()
        stalled.hit = 3  # the rank catches up
        assert client.lookup("r2", TOKENS) == 3  # the next request asks again: a hit
        assert answering.request_ids() == ["r1", "r2"]
    finally:
        client.close()


def test_a_late_answer_is_not_taken_for_the_next_request(ranks, engine) -> None:
    rank = ranks(None)
    client = tier(engine([rank.endpoint]), 1)
    try:
        assert client.lookup("r1", TOKENS) == 0
        rank.answer_stalled(4)  # r1's answer, late
        assert client.lookup("r2", TOKENS) == 0  # r2 gets none: not r1's 4
        rank.hit = 1
        assert client.lookup("r3", TOKENS) == 1
        assert client.counters.take() == {"lookup_timeouts": 2}
    finally:
        client.close()


def test_repeated_timeouts_back_off_then_a_recovered_rank_is_used_again(ranks, engine) -> None:
    answering, stalled = ranks(2), ranks(None)
    client = tier(engine([answering.endpoint, stalled.endpoint]), 2, backoff_s=0.5)
    try:
        for i in range(MAX_TIMEOUTS):
            assert not client.backoff.skipping()
            assert client.lookup(f"r{i}", TOKENS) == 0
        assert client.backoff.skipping()
        assert f"{MAX_TIMEOUTS} calls in a row without an answer" in client.backoff.reason
        assert client.counters.take() == {"lookup_timeouts": MAX_TIMEOUTS, "lookup_backoffs": 1}
        asked = len(stalled.requests)
        assert client.lookup("skipped", TOKENS) == 0  # backing off: nobody is asked
        assert len(stalled.requests) == asked == MAX_TIMEOUTS
        wait_until(lambda: not client.backoff.skipping(), "the backoff never ended")
        assert client.lookup("probe", TOKENS) == 0  # still stalled: the one probe is late
        assert client.backoff.skipping()  # and backs off again at once
        assert client.counters.take() == {"lookup_timeouts": 1, "lookup_backoffs": 1}
        stalled.answer_stalled(9)  # it comes back, answering what it had read...
        stalled.hit = 2  # ...and what comes next
        wait_until(lambda: not client.backoff.skipping(), "the backoff never ended")
        assert client.lookup("r-back", TOKENS) == 2  # the tier is used again
        assert client.lookup("r-next", TOKENS) == 2
        assert client.counters.take() == {}
    finally:
        client.close()


def test_a_dead_rank_backs_off_at_once_saying_why(ranks, engine) -> None:
    answering = ranks(2)
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens
    client = tier(engine([answering.endpoint, dead]), 2)
    try:
        assert client.lookup("r1", TOKENS) == 0
        assert client.backoff.skipping()
        assert f"{dead}: no connection took Lookup" in client.backoff.reason
        assert client.counters.take() == {"lookup_backoffs": 1}
        assert client.lookup("r2", TOKENS) == 0
        assert answering.request_ids() == ["r1"]
    finally:
        client.close()


def test_a_rank_with_another_secret_backs_off_at_once(ranks, engine) -> None:
    rank = ranks(2, secret="theirs")
    client = tier(engine([rank.endpoint]), 1, secret="ours")
    try:
        assert client.lookup("r1", TOKENS) == 0
        assert client.backoff.skipping() and "same transfer secret" in client.backoff.reason
    finally:
        client.close()


def test_ranks_not_known_yet_back_off_and_are_looked_for_again() -> None:
    engine_id = f"liveness-{uuid.uuid4().hex[:8]}"
    client = tier(engine_id, 1, backoff_s=0.2)
    rank = FakeRank(3)
    path = endpoint_file(engine_id, 0)
    try:
        assert client.lookup("r1", TOKENS) == 0
        assert "no endpoint file" in client.backoff.reason
        write_endpoint(path, rank.endpoint)  # the worker came up
        wait_until(lambda: not client.backoff.skipping(), "the backoff never ended")
        assert client.lookup("r2", TOKENS) == 3
    finally:
        client.close()
        rank.close()
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------- shared store
def shared_client(
    store: str, own: str, counters: FabricCounters, *, backoff_s: float = 10.0
) -> SharedTierClient:
    config = ConnectorConfig(chunk_tokens=CT, lookup_timeout_ms=BOUND_MS, shared_store=store)
    worker = WorkerTierClient(config, tp_size=1, engine_id=None)
    worker.endpoint = lambda: own  # type: ignore[method-assign]
    return SharedTierClient(config, worker, counters, backoff_s=backoff_s)


def test_a_late_shared_fetch_is_a_miss_for_that_request_only(ranks) -> None:
    store = ranks(None)
    counters = FabricCounters()
    client = shared_client(store.endpoint, "tcp://127.0.0.1:1", counters)
    try:
        started = time.monotonic()
        assert client.fetch("t1", TOKENS, 0) == 0
        assert time.monotonic() - started >= BOUND_MS / 1000
        assert not client.backoff.skipping()
        assert counters.take() == {"lookup_timeouts": 1}
        store.answer_stalled(4)  # t1's answer, late: not t2's
        store.hit = 3
        assert client.fetch("t2", TOKENS, 0) == 3
        assert counters.take() == {}
    finally:
        client.close()


# ---------------------------------------------------------------- scheduler
class LateTier:
    """A TierClient whose answers come too late: a miss, though a rank may hold."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def lookup(self, request_id: str, token_ids: list[int], identity: KeyIdentity) -> int:
        self.calls.append(request_id)
        return 0


def test_a_missed_lookup_releases_whatever_a_rank_held() -> None:
    s = FabricScheduler(ConnectorConfig(chunk_tokens=CT), BS, produce=True, consume=True)
    s.tier = LateTier()
    req = Req("r1", list(range(300)))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, [], 0)
    assert s.build_connector_meta(Out()).releases == ["r1"]
    waiting = Req("r2", list(range(300)))
    assert s.get_num_new_matched_tokens(waiting, 0) == (0, False)
    s.request_finished(waiting)  # aborted while it waited
    assert s.build_connector_meta(Out()).releases == ["r2"]


def decode_req(rid: str, n: int) -> Req:
    params = {"do_remote_prefill": True, "transfer_id": f"t-{rid}", "num_tokens": n}
    return Req(rid, list(range(n)), params)


def prefill_req(rid: str, n: int) -> Req:
    params = {
        "do_remote_decode": True,
        "transfer_id": f"t-{rid}",
        "decode_kv_endpoint": "tcp://x:1",
    }
    return Req(rid, list(range(n)), params)


class SomeShared(FakeShared):
    """A shared store holding ``chunks`` of the prompts of ``rids`` only."""

    def __init__(self, chunks: int, rids: set[str]) -> None:
        super().__init__(chunks)
        self.rids = rids

    def fetch(
        self, transfer_id: str, token_ids: list[int], min_chunks: int, identity: KeyIdentity
    ) -> int:
        if not any(transfer_id.startswith(f"shared-{rid}-") for rid in self.rids):
            return 0
        return super().fetch(transfer_id, token_ids, min_chunks, identity)


class Engine:
    """Drives a FabricScheduler in vLLM 0.32's hook order: per step,
    schedule() (get_num_new_matched_tokens for waiting requests,
    update_state_after_alloc for each one admitted, then
    build_connector_meta), then update_from_output (request_finished for
    what ended, then the stats: report_tables). Aborts call
    request_finished between steps."""

    def __init__(self, s: FabricScheduler) -> None:
        self.s = s
        self.blocks: dict[str, list[int]] = {}
        self._next_block = 0

    def ask(self, req: Req, computed: int = 0) -> tuple[int, bool]:
        return self.s.get_num_new_matched_tokens(req, computed)

    def admit(self, req: Req, external: int) -> None:
        n = -(-len(req.prompt_token_ids) // BS)
        self.blocks[req.request_id] = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        self.s.update_state_after_alloc(req, self.blocks[req.request_id], external)

    def step(
        self,
        new: tuple[tuple[Req, int, int], ...] = (),
        cached: tuple[tuple[Req, int, int], ...] = (),
        resumed: frozenset[str] = frozenset(),
        finished: tuple[Req, ...] = (),
    ) -> None:
        """``new``/``cached``: (request, computed tokens, scheduled tokens)."""
        cached_reqs = Cached(
            [r.request_id for r, _, _ in cached],
            set(resumed),
            [
                (self.blocks[r.request_id],) if r.request_id in resumed else None
                for r, _, _ in cached
            ],
            [c for _, c, _ in cached],
        )
        scheduled = {r.request_id: n for r, _, n in (*new, *cached)}
        news = [NewReq(r.request_id, (self.blocks[r.request_id],), c) for r, c, _ in new]
        self.s.build_connector_meta(Out(news, cached_reqs, scheduled))
        for req in finished:
            self.s.request_finished(req)
        self.s.report_tables()


def test_every_table_is_empty_once_every_request_ended_however_it_ended() -> None:
    config = ConnectorConfig(chunk_tokens=CT, lease_ms=10_000)
    shared_store = SomeShared(4, {"shared", "waiting"})
    s = FabricScheduler(
        config, BS, produce=True, consume=True, tier=FakeTier(2), shared=shared_store
    )
    e = Engine(s)
    done = Req("done", list(range(150)))  # a store hit; saves its chunks; finishes
    waiting = Req("waiting", list(range(300)))  # a shared fetch; aborted before it got blocks
    fallback = decode_req("fallback", 200)  # its pushed KV never arrives: recomputed
    shared = Req("shared", list(range(300)))  # its shared fetch fails to load: recomputed
    never = decode_req("never", 200)  # waits for blocks until its client goes away
    preempted = prefill_req("preempted", 200)  # pushes, preempted, asks again, resumes
    bypassed = Req("bypassed", list(range(300)))
    bypassed.prompt_embeds = object()  # type: ignore[attr-defined]

    # step 1: everyone asks; vLLM admits some
    assert e.ask(done, 16) == (2 * CT - 16, False)
    assert e.ask(shared) == (4 * CT, True)
    assert e.ask(waiting) == (4 * CT, True)
    assert e.ask(fallback) == e.ask(never) == (200, True)
    assert e.ask(preempted) == (2 * CT, False)
    assert e.ask(bypassed) == (0, False)
    e.admit(done, 2 * CT - 16)
    e.admit(shared, 4 * CT)
    e.admit(fallback, 200)
    e.admit(preempted, 2 * CT)
    e.admit(bypassed, 0)
    e.step(new=((done, 2 * CT, 22), (preempted, 2 * CT, 8), (bypassed, 0, 64)))
    # between steps: waiting's client is gone
    s.request_finished(waiting)
    # step 2: both loads failed; vLLM reschedules them from scratch
    assert e.ask(fallback) == (0, False)  # one load attempt, then it computes
    e.admit(fallback, 0)
    assert e.ask(shared) == (2 * CT, False)  # no second fetch; the own store's hit
    e.admit(shared, 2 * CT)
    assert e.ask(never) == (200, True)  # still no blocks for it
    e.step(
        new=((fallback, 0, 200), (shared, 2 * CT, 172)),
        cached=((done, 2 * CT, 0), (preempted, 2 * CT + 8, 0), (bypassed, 64, 236)),
        finished=(done,),
    )
    # step 3: preempted lost its blocks (vLLM calls no hook), asks again, resumes
    assert e.ask(preempted) == (2 * CT, False)
    e.admit(preempted, 2 * CT)
    e.step(cached=((preempted, 2 * CT, 72),), resumed=frozenset({"preempted"}))
    # step 4: the rest ends; never's client is gone (finish_requests)
    s.request_finished(never)
    e.step(finished=(fallback, shared, preempted, bypassed))
    # step 5: vLLM schedules once more to tell the workers what finished
    e.step()
    empty = dict.fromkeys(s.table_sizes(), 0)
    assert s.table_sizes() == empty
    assert s.counters.take()[TABLES_KEY] == {"scheduler": empty}


# ---------------------------------------------------------------- connector
def scheduler_connector(tmp_path: Path) -> Any:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from fabric.integrations.vllm.connector import FabricConnector

    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"chunk_tokens": CT, "kv_port": free_port()},
            kv_role="kv_both",
            engine_id="liveness",
        ),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, rank=0, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model=str(tmp_path)),
    )
    return FabricConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]


class SlowTier(FakeTier):
    def lookup(self, request_id: str, token_ids: list[int], identity: KeyIdentity) -> int:
        time.sleep(0.05)
        return super().lookup(request_id, token_ids, identity)


def test_the_scheduler_hold_is_observed_once_per_step_with_the_tables(tmp_path: Path) -> None:
    c = scheduler_connector(tmp_path)
    try:
        c._scheduler.tier = SlowTier(2)
        req = Req("r1", list(range(300)))
        blocks = SimpleNamespace(get_block_ids=lambda: ([*range(19)],))
        assert c.get_num_new_matched_tokens(req, 0) == (2 * CT, False)
        c.update_state_after_alloc(req, blocks, 2 * CT)
        c.build_connector_meta(Out([NewReq("r1", (list(range(19)),), 2 * CT)], Cached(), {}))
        stats = c.get_kv_connector_stats()
        [held] = stats.data["scheduler_hold_seconds"]
        assert held >= 0.05  # the lookup's wait is part of the step's hold
        assert stats.data[TABLES_KEY]["scheduler"]["scheduler_sending"] == 1
        c.request_finished(req, [])
        c.build_connector_meta(Out())  # the step after: request_finished counts in it
        stats = c.get_kv_connector_stats()
        assert len(stats.data["scheduler_hold_seconds"]) == 1  # one sample per step
        assert set(stats.data[TABLES_KEY]["scheduler"].values()) == {0}
    finally:
        c.shutdown()
