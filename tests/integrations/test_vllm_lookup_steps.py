"""Lookups across scheduler steps against a real worker with a disk tier.

The scheduler (``FabricScheduler`` over a real ``WorkerTierClient``) asks a
real worker's control endpoint, in vLLM's hook order; the worker's store has
the prompt on disk only, and the disk read is held until the test lets it
go, so a hold that reads from disk answers after the step's wait, every
time, however fast this box is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.scheduler import FabricScheduler
from fabric.integrations.vllm.tier_client import WorkerTierClient
from fabric.integrations.vllm.worker import FabricWorker
from fabric.transfer.tier_requests import in_process, leave_process
from tests.integrations.test_vllm_reuse_scheduler import Clock
from tests.integrations.test_vllm_reuse_worker import TOKENS, assert_blocks_equal, make, save_prompt
from tests.integrations.test_vllm_scheduler import Req
from tests.integrations.test_vllm_scheduler_liveness import Engine
from tests.integrations.test_vllm_worker import BS, CT

SRC = list(range(16))  # the blocks the prompt's 4 chunks were computed in


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[FabricWorker]:
    w = make(tmp_path)
    yield w
    w.shutdown()


@pytest.fixture(params=["read", "begin"])
def gate(
    request: pytest.FixtureRequest, worker: FabricWorker, monkeypatch: pytest.MonkeyPatch
) -> Iterator[threading.Event]:
    """The prompt on disk only; until the gate opens, every disk read waits
    ("read": the lookup has begun) or every lookup waits to begin ("begin")."""
    save_prompt(worker, "r0", SRC)
    tier = worker.tier
    assert tier is not None and tier.disk is not None and tier.flush(10)
    assert worker.store.drop_unused() == 4
    opened = threading.Event()
    owner: object = tier.disk if request.param == "read" else tier
    name = "read_into" if request.param == "read" else "lookup"
    real = getattr(owner, name)

    def gated(*args: object, **kwargs: object) -> object:
        assert opened.wait(60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, gated)
    yield opened
    opened.set()


def engine(worker: FabricWorker) -> tuple[Engine, WorkerTierClient]:
    assert worker.node is not None
    port = int(worker.node.endpoint.rpartition(":")[2])  # NOTE: not the shared endpoint file
    config = ConnectorConfig(chunk_tokens=CT, lease_ms=10_000, kv_port=port)  # default waits
    client = WorkerTierClient(config, tp_size=1, engine_id=None, clock=Clock())
    s = FabricScheduler(
        config, BS, produce=False, consume=False, tier=client, counters=client.counters
    )
    return Engine(s), client


def test_a_disk_hit_slower_than_the_steps_wait_loads_in_a_later_step(
    worker: FabricWorker, gate: threading.Event
) -> None:
    e, client = engine(worker)
    req = Req("r1", TOKENS)
    try:
        assert e.ask(req) == (None, False)  # the hold reads from disk: not this step
        assert e.ask(req) == (None, False)
        gate.set()
        answer, releases = e.ask_until_answered(req)
        assert answer == (4 * CT, False)  # the disk hit, not a miss
        assert releases == []
        dst = list(range(20, 36))
        e.blocks["r1"] = dst  # what vLLM allocated for it
        e.s.update_state_after_alloc(req, dst, 4 * CT)
        worker.start_load(e.step())
        assert_blocks_equal(worker, SRC, dst)
        assert worker.take_load_errors() == set()
        counts = client.counters.take()
        assert "lookup_timeouts" not in counts and "lookup_backoffs" not in counts
    finally:
        client.close()


def test_a_request_aborted_while_its_disk_lookup_runs_leaves_nothing_held(
    worker: FabricWorker, gate: threading.Event
) -> None:
    e, client = engine(worker)
    req = Req("r1", TOKENS)
    try:
        assert e.ask(req) == (None, False)
        e.s.request_finished(req)  # the client went away
        meta = e.step()
        assert meta.releases == ["r1"]
        worker.start_load(meta)  # applied while the lookup reads, or before it begins
        gate.set()
        deadline = time.monotonic() + 30
        while any(e.s.table_sizes().values()):  # its answer comes: released again if held
            assert time.monotonic() < deadline, e.s.table_sizes()
            worker.start_load(e.step())
            time.sleep(0.01)
        tier = worker.tier
        assert tier is not None and tier.held_count() == 0
        assert worker.store.table_sizes()["store_referenced_slots"] == 0
    finally:
        client.close()


def test_at_tp1_a_memory_hit_is_answered_on_the_schedulers_thread_at_its_first_ask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM at TP 1 runs the worker in the scheduler's process: a lookup that
    reads no disk is a call. The worker's loop is stuck on the first tier
    request it gets, so a lookup asked over the socket is not answered in
    its step (nor in any step until the test ends)."""
    w = make(None)  # memory only
    client: WorkerTierClient | None = None
    stuck = threading.Event()
    try:
        save_prompt(w, "r0", SRC)
        assert w.node is not None and w.node.server is not None
        server = w.node.server
        real = server._on_tier

        def on_tier(*args: object) -> object:
            stuck.wait(60)
            return real(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(server, "_on_tier", on_tier)
        e, client = engine(w)
        req = Req("r1", TOKENS)
        assert e.ask(req) == (4 * CT, False)
        dst = list(range(20, 36))
        e.blocks["r1"] = dst
        e.s.update_state_after_alloc(req, dst, 4 * CT)
        w.start_load(e.step())
        assert_blocks_equal(w, SRC, dst)
        assert w.take_load_errors() == set()
        assert server.stats.lookups_in_process == 1
        assert "lookups_deferred" not in client.counters.take()
        e.s.request_finished(req)
        w.start_load(e.step())  # the release
        assert w.tier is not None and w.tier.held_count() == 0
    finally:
        stuck.set()
        if client is not None:
            client.close()
        endpoint = w.node.endpoint if w.node is not None else ""
        w.shutdown()
    assert in_process(endpoint) is None  # a closed server is not asked in process


def test_a_memory_hit_asked_over_the_socket_loads_too() -> None:
    """The same lookup where the worker is another process (vLLM's CPU
    build, TP > 1): over the control socket, answered within a few steps."""
    w = make(None)
    client: WorkerTierClient | None = None
    try:
        save_prompt(w, "r0", SRC)
        assert w.node is not None and w.node.server is not None
        server = w.node.server
        leave_process(server)  # NOTE: as seen from another process
        e, client = engine(w)
        req = Req("r1", TOKENS)
        answer, releases = e.ask_until_answered(req)
        assert (answer, releases) == ((4 * CT, False), [])
        dst = list(range(20, 36))
        e.blocks["r1"] = dst
        e.s.update_state_after_alloc(req, dst, 4 * CT)
        w.start_load(e.step())
        assert_blocks_equal(w, SRC, dst)
        assert (server.stats.lookups, server.stats.lookups_in_process) == (1, 0)
    finally:
        if client is not None:
            client.close()
        w.shutdown()
