"""A request's end is never lost, whenever the load thread takes it.

vLLM names an aborted request finished in a later step than the one that
planned its load, but both can be queued before the load thread's round
takes them: the round that took no plan (it found none) then sees the end
first. Here that round is parked until both are queued, so the end is
seen before its plan: the load is still ended and reported at once, not
after its timeouts (600 s here).
"""

from __future__ import annotations

import queue
import threading
import time

from fabric.integrations.vllm.loader import Loader
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan
from fabric.integrations.vllm.worker import FabricWorker
from tests.integrations.test_vllm_worker import tokens, worker


class ParkedPlans(queue.Queue[LoadPlan]):
    """The load thread's plan queue: its next blocking take (an idle round)
    parks until ``gate`` opens, then finds nothing, as if the plan came
    just after that take gave up."""

    def __init__(self) -> None:
        super().__init__()
        self.parked, self.gate = threading.Event(), threading.Event()

    def get(self, block: bool = True, timeout: float | None = None) -> LoadPlan:
        if block and not self.gate.is_set():
            self.parked.set()
            assert self.gate.wait(60), "the test never opened the gate"
            raise queue.Empty
        return super().get(block, timeout)


def reported(d: FabricWorker, timeout: float = 15) -> tuple[set[str], set[str]]:
    """The first non-empty results (a hang guard far below the 600 s timeouts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished, failed = d.get_results(set())
        if finished:
            return finished, failed
        time.sleep(0.01)
    raise AssertionError("the ended load was never reported")


def test_an_end_queued_with_its_plan_before_the_round_took_either_ends_the_load() -> None:
    d = worker(
        produce=False, consume=True, seed=2, load_timeout_s=600, unknown_transfer_grace_s=600
    )
    try:
        loader = d.loader
        assert isinstance(loader, Loader)
        plans = ParkedPlans()
        loader._plans = plans  # NOTE: the idle thread's next round takes from it
        try:
            assert plans.parked.wait(30), "the load thread never waited for a plan"
            plan = LoadPlan("d1", "t-never", 0, [1, 2, 3, 4], 64, tokens(64))
            d.start_load(FabricMetadata(loads=[plan]))  # the step that plans the load
            assert d.get_results({"d1"}) == (set(), set())  # a later step: vLLM aborted it
        finally:
            plans.gate.set()
        assert reported(d) == ({"d1"}, {"d1"})
        assert loader.table_sizes() == {
            "loader_plans": 0,
            "loader_active": 0,
            "loader_finished": 0,
            "loader_failed": 0,
            "loader_claims": 0,
            "loader_open": 0,
        }
        assert d.counters.take()["loads_ended"] == 1
    finally:
        d.shutdown()
