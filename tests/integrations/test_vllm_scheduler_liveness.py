"""The engine's scheduler never waits on the network for long.

Reuse-tier lookups against real ZMQ ROUTER sockets standing in for TP
ranks (one answers, one answers late, one reads and never answers, one is
not there), driven through FabricScheduler in vLLM's hook order: a request
not answered within the step's wait is asked again in later steps, a miss
only past the deadline (deadlines and backoffs run on a fake clock, so no
test depends on how fast this box schedules threads); the shared store's
fetch on the same terms; holds that late answers leave are released; the
scheduler hold observed once per step; the scheduler's per-request tables
empty once every request has ended, however it ended.
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
import zmq

from fabric.integrations.vllm import tier_client as tier_module
from fabric.integrations.vllm.config import ConnectorConfig, endpoint_file
from fabric.integrations.vllm.counters import TABLES_KEY, FabricCounters
from fabric.integrations.vllm.metadata import FabricMetadata
from fabric.integrations.vllm.scheduler import FabricScheduler
from fabric.integrations.vllm.tier_client import (
    GAUGE_MAX_LATE,
    GAUGE_PROBE_EVERY,
    GAUGE_WINDOW,
    MAX_IN_FLIGHT,
    MAX_TIMEOUTS,
    SharedTierClient,
    WaitGauge,
    WorkerTierClient,
)
from fabric.kv.identity import BASE, KeyIdentity
from fabric.launch.process import free_port
from fabric.transfer.store_client import SOCKET_HWM, write_endpoint
from tests.integrations.test_vllm_reuse_scheduler import Clock, FakeTier
from tests.integrations.test_vllm_scheduler import BS, CT, Cached, NewReq, Out, Req
from tests.integrations.test_vllm_shared_store import FakeShared
from tests.transfer.test_store_client import FakeRank

TOKENS = list(range(4 * CT))
PROMPT = [*TOKENS, 7]  # 4 full chunks usable (vLLM computes the last token)
STEP_MS = 50  # lookup_timeout_ms: the step's wait (above the default, for a noisy box)
DEADLINE_MS = 2000
BACKOFF_S = 10.0
GUARD_S = 30  # hang guard only


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


def config(**extra: Any) -> ConnectorConfig:
    settings: dict[str, Any] = {"lookup_timeout_ms": STEP_MS, "lookup_deadline_ms": DEADLINE_MS}
    return ConnectorConfig(chunk_tokens=CT, lease_ms=10_000, **(settings | extra))


def tier(
    engine_id: str, tp_size: int, clock: Clock | None = None, **extra: Any
) -> WorkerTierClient:
    """The scheduler's client of the engine's ranks; its deadlines and
    backoffs run on ``clock`` (the waits inside a step are real)."""
    return WorkerTierClient(
        config(**extra),
        tp_size=tp_size,
        engine_id=engine_id,
        backoff_s=BACKOFF_S,
        clock=clock or Clock(),
    )


def counts(counters: FabricCounters) -> dict[str, Any]:
    """The counters since the last call, less ``lookups_deferred`` and the
    steps' waits (whether a first ask was answered within its step's wait,
    and how long it took, depend on this box)."""
    taken = counters.take()
    taken.pop("lookups_deferred", None)
    taken.pop("lookup_waits_skipped", None)
    for name in list(taken):
        if name.startswith(("scheduler_wait_seconds", "scheduler_wait_overrun")):
            del taken[name]
    taken.pop(TABLES_KEY, None)
    return taken


def answer(client: WorkerTierClient, rid: str) -> int:
    """Ask as steps do until the request is answered (the clock stands still)."""
    deadline = time.monotonic() + GUARD_S
    while (chunks := client.ask(rid, TOKENS, BASE, STEP_MS / 1000)) is None:
        assert time.monotonic() < deadline, f"{rid} never answered"
        client.poll()
        time.sleep(0.001)
    return chunks


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def answered_but(
    client: WorkerTierClient, rid: str, endpoint: str, reached: FakeRank | None = None
) -> Callable[[], bool]:
    """Whether every rank but ``endpoint`` answered ``rid`` (asking again, as
    steps do) and, with ``reached``, that rank got it."""

    def check() -> bool:
        pending = client.ask(rid, TOKENS, BASE, 0) is None
        got = reached is None or rid in reached.request_ids()
        return pending and got and client.waiting_on(rid) == [endpoint]

    return check


# ---------------------------------------------------------------- reuse tier
def test_tp_ranks_are_asked_in_parallel(ranks, engine) -> None:
    """Rank 0 answers only once rank 1 got its request: asked one after the
    other (rank 1 after rank 0's answer), rank 0 would never answer."""
    rank1_asked = threading.Event()
    rank0 = ranks(3, before_answer=lambda: rank1_asked.wait(GUARD_S))
    rank1 = ranks(2, on_request=rank1_asked.set)
    client = tier(engine([rank0.endpoint, rank1.endpoint]), 2)
    try:
        assert answer(client, "r1") == 2  # the smaller hit wins
        assert counts(client.counters) == {}
    finally:
        client.close()


def test_one_late_rank_is_a_miss_only_past_the_deadline_not_a_blackout(ranks, engine) -> None:
    answering, stalled = ranks(3), ranks(None)
    clock = Clock()
    client = tier(engine([answering.endpoint, stalled.endpoint]), 2, clock)
    try:
        assert client.ask("r1", TOKENS, BASE, STEP_MS / 1000) is None
        wait_until(answered_but(client, "r1", stalled.endpoint, stalled), "not asked")
        clock.now += DEADLINE_MS / 1000 - 0.001
        assert client.ask("r1", TOKENS, BASE, 0) is None  # not yet
        clock.now += 0.001
        assert client.ask("r1", TOKENS, BASE, 0) == 0  # a miss: vLLM computes r1
        assert counts(client.counters) == {"lookup_timeouts": 1}
        assert not client.backoff.skipping()
        stalled.hit = 3  # the rank catches up
        assert answer(client, "r2") == 3  # the next request asks again: a hit
        assert answering.request_ids() == ["r1", "r2"]
    finally:
        client.close()


def test_a_late_answer_is_not_taken_for_the_next_request(ranks, engine) -> None:
    rank = ranks(None)
    clock = Clock()
    client = tier(engine([rank.endpoint]), 1, clock)
    try:
        assert client.ask("r1", TOKENS, BASE, 0) is None
        wait_until(lambda: client.ask("r1", TOKENS, BASE, 0) is None and rank.requests, "sent")
        clock.now += DEADLINE_MS / 1000
        assert client.ask("r1", TOKENS, BASE, 0) == 0
        rank.answer_stalled(4)  # r1's answer, late
        assert client.ask("r2", TOKENS, BASE, 0) is None  # r2 gets none: not r1's 4
        wait_until(lambda: client.poll() == ["r1"], "r1's late hold never showed")
        rank.wait_requests(2)
        clock.now += DEADLINE_MS / 1000
        assert client.ask("r2", TOKENS, BASE, 0) == 0
        rank.hit = 1
        assert answer(client, "r3") == 1
        assert counts(client.counters) == {"lookup_timeouts": 2}
    finally:
        client.close()


def test_repeated_deadline_misses_back_off_then_a_recovered_rank_is_used_again(
    ranks, engine
) -> None:
    answering, stalled = ranks(2), ranks(None)
    clock = Clock()
    client = tier(engine([answering.endpoint, stalled.endpoint]), 2, clock)
    try:
        for i in range(MAX_TIMEOUTS):
            assert not client.backoff.skipping()
            assert client.ask(f"r{i}", TOKENS, BASE, 0) is None
            wait_until(answered_but(client, f"r{i}", stalled.endpoint, stalled), "not asked")
            clock.now += DEADLINE_MS / 1000
            assert client.ask(f"r{i}", TOKENS, BASE, 0) == 0
        assert client.backoff.skipping()
        assert f"{MAX_TIMEOUTS} calls in a row without an answer" in client.backoff.reason
        assert counts(client.counters) == {"lookup_timeouts": MAX_TIMEOUTS, "lookup_backoffs": 1}
        # the sockets went with the backoff: nothing is watched for the stalled rank
        assert set(client.table_sizes().values()) == {0}
        assert client.ask("skipped", TOKENS, BASE, 0) == 0  # backing off: nobody is asked
        clock.now += BACKOFF_S
        assert client.ask("probe", TOKENS, BASE, 0) is None  # one request probes it...
        assert client.ask("other", TOKENS, BASE, 0) == 0  # ...the others miss meanwhile
        wait_until(answered_but(client, "probe", stalled.endpoint, stalled), "not asked")
        clock.now += DEADLINE_MS / 1000
        assert client.ask("probe", TOKENS, BASE, 0) == 0  # still stalled
        assert client.backoff.skipping()  # and backs off again at once
        assert counts(client.counters) == {"lookup_timeouts": 1, "lookup_backoffs": 1}
        assert stalled.request_ids() == [*(f"r{i}" for i in range(MAX_TIMEOUTS)), "probe"]
        stalled.answer_stalled(9)  # it comes back, answering what it had read...
        stalled.hit = 2  # ...and what comes next
        clock.now += BACKOFF_S
        assert answer(client, "r-back") == 2  # the tier is used again
        assert answer(client, "r-next") == 2
        assert counts(client.counters) == {}
    finally:
        client.close()


def test_a_dead_rank_backs_off_at_the_deadline_saying_why(ranks, engine) -> None:
    answering = ranks(2)
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens
    clock = Clock()
    client = tier(engine([answering.endpoint, dead]), 2, clock)
    try:
        assert client.ask("r1", TOKENS, BASE, 0) is None
        wait_until(answered_but(client, "r1", dead), "rank 0 never answered")
        clock.now += DEADLINE_MS / 1000
        assert client.ask("r1", TOKENS, BASE, 0) == 0
        assert client.backoff.skipping()
        assert f"{dead}: no connection took Lookup" in client.backoff.reason
        assert counts(client.counters) == {"lookup_backoffs": 1}
        assert client.ask("r2", TOKENS, BASE, 0) == 0
        assert answering.request_ids() == ["r1"]
    finally:
        client.close()


def test_a_rank_with_another_secret_backs_off_at_once(ranks, engine) -> None:
    rank = ranks(2, secret="theirs")
    client = tier(engine([rank.endpoint]), 1, secret="ours")
    try:
        assert answer(client, "r1") == 0  # refused: no deadline needed (the clock stands still)
        assert client.backoff.skipping() and "same transfer secret" in client.backoff.reason
    finally:
        client.close()


def test_a_busy_rank_is_asked_again_not_backed_off(ranks, engine) -> None:
    rank = ranks(3, busy=2)  # its queue is full for the first two lookups
    client = tier(engine([rank.endpoint]), 1)
    try:
        assert answer(client, "r1") == 3
        assert rank.request_ids() == ["r1"] * 3
        assert counts(client.counters) == {}
        assert not client.backoff.skipping()
    finally:
        client.close()


def test_ranks_not_known_yet_back_off_and_are_looked_for_again() -> None:
    engine_id = f"liveness-{uuid.uuid4().hex[:8]}"
    clock = Clock()
    client = tier(engine_id, 1, clock)
    rank = FakeRank(3)
    path = endpoint_file(engine_id, 0)
    try:
        assert client.ask("r1", TOKENS, BASE, 0) == 0
        assert "no endpoint file" in client.backoff.reason
        write_endpoint(path, rank.endpoint)  # the worker came up
        clock.now += BACKOFF_S
        assert answer(client, "r2") == 3
    finally:
        client.close()
        rank.close()
        path.unlink(missing_ok=True)


def test_the_clients_sockets_queue_little_and_never_linger(ranks, engine) -> None:
    rank = ranks(2)
    client = tier(engine([rank.endpoint]), 1)
    try:
        assert answer(client, "r1") == 2
        [store] = client._clients or []
        sock = store._sock
        assert sock is not None
        assert sock.getsockopt(zmq.SNDHWM) == sock.getsockopt(zmq.RCVHWM) == SOCKET_HWM <= 16
        assert sock.getsockopt(zmq.LINGER) == 0 and sock.getsockopt(zmq.IMMEDIATE) == 1
    finally:
        client.close()


# ---------------------------------------------------------------- through the scheduler
class Engine:
    """Drives a FabricScheduler in vLLM 0.32's hook order: per step,
    schedule() (get_num_new_matched_tokens for waiting requests,
    update_state_after_alloc for each one admitted, then
    build_connector_meta), then update_from_output (request_finished for
    what ended, then the stats: report_tables). Aborts call
    request_finished between steps. A request answered (None, False) is
    skipped for the step and asked again in the next one
    (``vllm/v1/core/sched/scheduler.py:990``)."""

    def __init__(self, s: FabricScheduler) -> None:
        self.s = s
        self.blocks: dict[str, list[int]] = {}
        self._next_block = 0

    def ask(self, req: Req, computed: int = 0) -> tuple[int | None, bool]:
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
    ) -> FabricMetadata:
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
        meta = self.s.build_connector_meta(Out(news, cached_reqs, scheduled))
        for req in finished:
            self.s.request_finished(req)
        self.s.report_tables()
        return meta

    def ask_until_answered(self, req: Req) -> tuple[tuple[int | None, bool], list[str]]:
        """Ask once per (empty) step until answered; the answer and the
        releases the steps shipped. vLLM sleeps 1 ms after a step that ran
        nothing (``vllm/v1/engine/core.py:1616``)."""
        deadline, releases = time.monotonic() + GUARD_S, []
        while (answer := self.ask(req))[0] is None:
            assert time.monotonic() < deadline, f"{req.request_id} never answered"
            releases += self.step().releases
            time.sleep(0.001)
        return answer, releases


def scheduler(client: Any, clock: Clock) -> FabricScheduler:
    """A scheduler over ``client``, sharing its counters (as the connector does)."""
    counters = getattr(client, "counters", None)
    return FabricScheduler(
        config(), BS, produce=False, consume=False, tier=client, clock=clock, counters=counters
    )


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The timeouts (ms) the tier clients' polls for answers were given."""
    given: list[float] = []
    real_wait = tier_module.wait_ready

    def recording_wait(receiving: Any, timeout_ms: float, sending: Any = ()) -> None:
        given.append(timeout_ms)
        real_wait(receiving, timeout_ms, sending)

    monkeypatch.setattr(tier_module, "wait_ready", recording_wait)
    return given


def test_a_rank_slower_than_the_steps_wait_costs_steps_not_the_hit(ranks, engine, waits) -> None:
    """A hold that reads its chunks from disk first answers after the step's
    wait: the request waits a step or a few and loads its hit."""
    fast = ranks(3)
    slow = ranks(3, before_answer=lambda: time.sleep(0.3))  # 6x the step's wait
    clock = Clock()
    client = tier(engine([fast.endpoint, slow.endpoint]), 2, clock)
    s = scheduler(client, clock)
    e = Engine(s)
    req = Req("r1", PROMPT)
    try:
        assert e.ask(req) == (None, False)  # not this step: vLLM skips r1, asks again
        assert 0 < max(waits) <= STEP_MS  # the first ask waited, within the step's wait
        assert s.table_sizes()["scheduler_lookups"] == 1
        waits.clear()
        answer, releases = e.ask_until_answered(req)
        assert answer == (3 * CT, False)  # the hit, not a miss
        assert waits == []  # the later asks never waited
        assert releases == []
        e.admit(req, 3 * CT)
        meta = e.step(new=((req, 3 * CT, 1),))
        assert [load.num_chunks for load in meta.local_loads] == [3]
        assert s.counters.take()["lookups_deferred"] == 1
        assert counts(s.counters) == {}  # no timeout, no backoff
        assert not client.backoff.skipping()
    finally:
        client.close()


def test_first_asks_stop_waiting_while_answers_miss_their_wait_and_a_probe_resumes(
    ranks, engine, waits
) -> None:
    """A rank slower than the step's wait every time (a machine whose cores
    are all busy): after a window of first asks that waited in vain, first
    asks send and go on, but one in GAUGE_PROBE_EVERY; once the rank is
    fast again, the next probe is answered in its wait and first asks wait
    again."""
    slow = threading.Event()
    slow.set()
    rank = ranks(3, before_answer=lambda: slow.is_set() and time.sleep(0.15))  # 3x the wait
    client = tier(engine([rank.endpoint]), 1, Clock())
    asked = 0

    def first_ask() -> tuple[bool, bool]:
        """(waited, answered in the step) for a new request, then its answer."""
        nonlocal asked
        asked += 1
        waits.clear()
        chunks = client.ask(f"r{asked}", TOKENS, BASE, STEP_MS / 1000)
        waited = bool(waits) and max(waits) > 0
        assert answer(client, f"r{asked}") == 3
        return waited, chunks is not None

    try:
        # NOTE: asks left a sliver of the step's wait teach the gauge nothing
        for i in range(GAUGE_WINDOW):
            assert client.ask(f"sliver{i}", TOKENS, BASE, STEP_MS / 1000 / 10) is None
            assert answer(client, f"sliver{i}") == 3
        assert client._asks.gauge.pays()
        assert [first_ask() for _ in range(GAUGE_WINDOW)] == [(True, False)] * GAUGE_WINDOW
        skipped = [(False, False)] * (GAUGE_PROBE_EVERY - 1)
        assert [first_ask() for _ in range(GAUGE_PROBE_EVERY)] == [*skipped, (True, False)]
        assert client.counters.take()["lookup_waits_skipped"] == GAUGE_PROBE_EVERY - 1
        slow.clear()
        # NOTE: a rank that answers at once: a probe's answer comes within its 50 ms
        # wait, unless this box stalls the test that long (then the next probe)
        for _ in range(3):
            *skips, probe = [first_ask() for _ in range(GAUGE_PROBE_EVERY)]
            assert skips == skipped and probe[0]
            if probe[1]:
                break
        assert probe == (True, True)
        assert first_ask()[0]  # waiting again
        assert counts(client.counters) == {}  # no timeout, no backoff
    finally:
        client.close()


def test_first_asks_stop_waiting_while_waits_come_back_late() -> None:
    """Answers that came in time, but a scheduler thread that got its core
    back late (a busy machine) more than GAUGE_MAX_LATE times in the window:
    waiting stalls the running requests, so first asks stop waiting until a
    probe is answered and back on time."""
    gauge = WaitGauge()
    for i in range(GAUGE_WINDOW):
        assert gauge.wait_s(0.002) == 0.002
        gauge.record(True, late=i <= GAUGE_MAX_LATE)  # GAUGE_MAX_LATE + 1 late
    assert [gauge.wait_s(0.002) for _ in range(GAUGE_PROBE_EVERY)] == [0.0] * (
        GAUGE_PROBE_EVERY - 1
    ) + [0.002]
    gauge.record(True, late=True)  # a probe back late: still not waiting
    assert gauge.wait_s(0.002) == 0.0
    assert gauge.wait_s(0.0) == 0.0  # nothing left of the step's wait: nothing to skip
    for _ in range(GAUGE_PROBE_EVERY - 2):
        gauge.wait_s(0.002)
    assert gauge.wait_s(0.002) == 0.002  # the next probe
    gauge.record(True, late=False)
    assert gauge.pays() and gauge.wait_s(0.002) == 0.002


def test_a_rank_that_never_answers_is_a_miss_at_the_deadline(ranks, engine) -> None:
    answering, stalled = ranks(3), ranks(None)
    clock = Clock()
    client = tier(engine([answering.endpoint, stalled.endpoint]), 2, clock)
    e = Engine(scheduler(client, clock))
    req = Req("r1", PROMPT)

    def step() -> bool:
        """One step in which r1 is not answered; whether both ranks got it."""
        assert e.ask(req) == (None, False)
        assert e.step().releases == []
        return "r1" in stalled.request_ids() and client.waiting_on("r1") == [stalled.endpoint]

    try:
        wait_until(step, "r1 never reached both ranks")
        for _ in range(4):  # steps go by: still not answered
            clock.now += DEADLINE_MS / 4000 - 0.001
            step()
        clock.now += 0.01
        assert e.ask(req) == (0, False)  # past the deadline: a miss, vLLM computes it
        assert counts(e.s.counters) == {"lookup_timeouts": 1}
        assert not client.backoff.skipping()
        e.admit(req, 0)
        assert e.step(new=((req, 0, len(PROMPT)),)).releases == ["r1"]  # what rank 0 held
    finally:
        client.close()


def test_a_request_that_ends_while_its_lookup_is_in_flight_has_its_hold_released(
    ranks, engine
) -> None:
    rank = ranks(None)  # reads the lookup; answers (holding) when told
    clock = Clock()
    client = tier(engine([rank.endpoint]), 1, clock)
    s = scheduler(client, clock)
    e = Engine(s)
    req = Req("r1", PROMPT)
    try:
        wait_until(lambda: e.ask(req) == (None, False) and bool(rank.requests), "not sent")
        s.request_finished(req)  # the client went away before the rank answered
        assert e.step().releases == ["r1"]  # at once (a lookup running then keeps nothing)
        assert s.table_sizes()["scheduler_lookups_abandoned"] == 1  # its answer is awaited
        rank.answer_stalled(2)  # the lookup runs only now, after that release: it holds
        releases: list[str] = []

        def released() -> bool:
            releases.extend(e.step().releases)
            return bool(releases)

        wait_until(released, "the late hold was never released")
        assert releases == ["r1"]  # so it is released again, once its answer says it held
        assert set(s.table_sizes().values()) == {0}
    finally:
        client.close()


def test_stale_lookups_do_not_pile_up_on_a_rank_stuck_on_some(ranks, engine) -> None:
    """A rank stuck on some lookups (say a disk read that hangs) while it
    answers the others at once: at most MAX_IN_FLIGHT of the stuck ones
    ever reach it (each would take a hold when it resumes), and they are
    let go with the sockets when the tier backs off."""
    rank = ranks(2, stalls=lambda msg: getattr(msg, "request_id", "").startswith("stuck"))
    clock = Clock()
    client = tier(engine([rank.endpoint]), 1, clock)
    e = Engine(scheduler(client, clock))
    reqs = [Req(f"{kind}{i}", PROMPT) for i in range(3 * MAX_IN_FLIGHT) for kind in ("stuck", "ok")]

    answered: set[str] = set()

    def stuck() -> list[str]:
        return [rid for rid in rank.request_ids() if rid.startswith("stuck")]

    def step() -> bool:
        """One step: every request not answered asks; whether the rank is full."""
        for req in reqs:
            if req.request_id not in answered and e.ask(req)[0] is not None:
                answered.add(req.request_id)
        e.step()
        return len(stuck()) == MAX_IN_FLIGHT

    try:
        wait_until(step, f"{MAX_IN_FLIGHT} stuck lookups never reached the rank")
        for _ in range(20):  # more steps go by; every request still asks
            step()
            time.sleep(0.01)  # NOTE: a grace for more to arrive; none may
        assert len(stuck()) == MAX_IN_FLIGHT
        clock.now += DEADLINE_MS / 1000
        waiting = [req for req in reqs if req.request_id not in answered]
        assert all(rid.startswith("ok") for rid in answered)
        assert {e.ask(req) for req in waiting} == {(0, False)}  # misses; the tier backs off
        assert client.backoff.skipping()
        assert set(client.table_sizes().values()) == {0}  # nothing watched: sockets gone
        rank.answer_stalled(2)  # it resumes: no socket is there to take those answers
        clock.now += BACKOFF_S
        answer, _ = e.ask_until_answered(Req("ok-fresh", PROMPT))
        assert answer == (2 * CT, False)
        assert len(stuck()) == MAX_IN_FLIGHT
    finally:
        client.close()


def test_the_steps_wait_is_shared_by_its_first_asks() -> None:
    """However many requests ask in one step, they wait lookup_timeout_ms
    in all: each first ask gets what the ones before it left."""

    class Stalled(FakeTier):
        def __init__(self) -> None:
            super().__init__(0)
            self.waits: list[float] = []

        def ask(
            self, request_id: str, token_ids: list[int], identity: KeyIdentity, wait_s: float
        ) -> int | None:
            self.waits.append(wait_s)
            time.sleep(wait_s)  # waits all it may, unanswered
            return None

    stalled = Stalled()
    e = Engine(scheduler(stalled, Clock()))
    for i in range(3):
        assert e.ask(Req(f"r{i}", PROMPT)) == (None, False)
    assert stalled.waits == [STEP_MS / 1000, 0.0, 0.0]
    e.step()
    assert e.ask(Req("r3", PROMPT)) == (None, False)
    assert stalled.waits[-1] == STEP_MS / 1000  # a new step, a new wait


# ---------------------------------------------------------------- shared store
def shared_client(store: str, counters: FabricCounters, clock: Clock) -> SharedTierClient:
    settings = config(shared_store=store)
    worker = WorkerTierClient(settings, tp_size=1, engine_id=None)
    worker.endpoint = lambda: "tcp://127.0.0.1:1"  # type: ignore[method-assign]
    return SharedTierClient(settings, worker, counters, backoff_s=BACKOFF_S, clock=clock)


def test_a_late_shared_fetch_is_a_miss_only_past_the_deadline(ranks) -> None:
    store = ranks(None)
    counters, clock = FabricCounters(), Clock()
    client = shared_client(store.endpoint, counters, clock)
    try:
        assert client.ask("t1", TOKENS, 0, BASE, STEP_MS / 1000) is None
        wait_until(lambda: client.ask("t1", TOKENS, 0, BASE, 0) is None and store.requests, "")
        clock.now += DEADLINE_MS / 1000
        assert client.ask("t1", TOKENS, 0, BASE, 0) == 0
        assert not client.backoff.skipping()
        assert counts(counters) == {"lookup_timeouts": 1}
        store.answer_stalled(4)  # t1's answer, late: not t2's
        store.hit = 3
        deadline = time.monotonic() + GUARD_S
        while (chunks := client.ask("t2", TOKENS, 0, BASE, STEP_MS / 1000)) is None:
            assert time.monotonic() < deadline, "t2 never answered"
            client.poll()
            time.sleep(0.001)
        assert chunks == 3
        assert counts(counters) == {}
    finally:
        client.close()


def test_a_slow_shared_fetch_loads_in_a_later_step(ranks) -> None:
    store = ranks(3, before_answer=lambda: time.sleep(0.3))
    counters, clock = FabricCounters(), Clock()
    client = shared_client(store.endpoint, counters, clock)
    s = FabricScheduler(
        config(), BS, produce=False, consume=False, tier=FakeTier(1), shared=client, clock=clock
    )
    e = Engine(s)
    req = Req("r1", PROMPT)
    try:
        assert e.ask(req) == (None, False)
        assert s.table_sizes()["scheduler_fetches"] == 1
        answer, releases = e.ask_until_answered(req)
        assert answer == (3 * CT, True)  # pushed by the shared store: an async load
        assert releases == []
        e.admit(req, 3 * CT)
        meta = e.step()
        assert [(load.num_tokens, load.shared) for load in meta.loads] == [(3 * CT, True)]
        assert meta.releases == ["r1"]  # the own store's 1-chunk hold
        assert len(store.requests) == 1  # one fetch, however many steps it took
        assert counts(counters) == {}
    finally:
        client.close()


# ---------------------------------------------------------------- scheduler
class LateTier(FakeTier):
    """A TierClient whose answers came too late: a miss, though a rank may hold."""

    def __init__(self) -> None:
        super().__init__(0)


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


def test_every_table_is_empty_once_every_request_ended_however_it_ended() -> None:
    config = ConnectorConfig(chunk_tokens=CT, lease_ms=10_000)
    shared_store = SomeShared(4, {"shared", "waiting"})
    s = FabricScheduler(
        config, BS, produce=True, consume=True, tier=FakeTier(2), shared=shared_store
    )
    e = Engine(s)
    done = Req("done", list(range(150)))  # a store hit; packs its chunks; finishes
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
            kv_connector_extra_config={
                "chunk_tokens": CT,
                "kv_port": free_port(),
                "lookup_timeout_ms": 2,  # NOTE: SlowTier's 50 ms overruns it
            },
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
        [waited] = stats.data["scheduler_wait_seconds"]  # and counted as its wait
        assert 0.05 <= waited <= held
        # NOTE: SlowTier sleeps 50 ms whatever the step's wait (2 ms): an overrun,
        # spent asleep (little CPU), not computing
        assert stats.data["scheduler_wait_overruns"] == 1
        assert stats.data["scheduler_wait_overrun_us"] >= 40_000
        assert stats.data["scheduler_wait_overrun_cpu_us"] < 20_000
        assert stats.data["scheduler_wait_overrun_runq_us"] >= 0
        assert stats.data[TABLES_KEY]["scheduler"]["scheduler_sending"] == 1
        c.request_finished(req, [])
        c.build_connector_meta(Out())  # the step after: request_finished counts in it
        stats = c.get_kv_connector_stats()
        assert len(stats.data["scheduler_hold_seconds"]) == 1  # one sample per step
        assert stats.data["scheduler_wait_seconds"] == [0.0]  # no ask: no wait
        assert set(stats.data[TABLES_KEY]["scheduler"].values()) == {0}
    finally:
        c.shutdown()


def test_a_hit_taken_steps_after_its_answer_is_dated_from_its_ask(ranks, engine) -> None:
    """vLLM may not ask a deferred request again for a long while (its batch
    is full: ``vllm/v1/core/sched/scheduler.py:923`` breaks out before the
    connector is asked); the worker's hold ages from the lookup, so the hit
    is refreshed half a lease after the ask, not after the answer was taken."""
    rank = ranks(None)  # reads the lookup; answers (holding) when told
    clock = Clock()
    client = tier(engine([rank.endpoint]), 1, clock)
    e = Engine(scheduler(client, clock))
    req = Req("r1", PROMPT)
    half_lease_s = config().lease_ms / 2000
    try:
        wait_until(lambda: e.ask(req) == (None, False) and bool(rank.requests), "not sent")
        rank.answer_stalled(2)
        wait_until(lambda: e.step() is not None and client.waiting_on("r1") == [], "no answer")
        clock.now += half_lease_s - 1  # the batch was full all along
        assert e.ask(req) == (2 * CT, False)
        clock.now += 2  # half a lease after the ask, one second after the answer
        assert e.ask(req) == (None, False)  # refreshed: the hold may end before the load
        rank.wait_requests(2)
    finally:
        client.close()
