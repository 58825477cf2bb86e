"""Scheduler side of the reuse tier: lookups, LocalLoads, packs, releases."""

from __future__ import annotations

from typing import Any

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.scheduler import FabricScheduler
from fabric.kv.identity import KeyIdentity
from tests.integrations.test_vllm_scheduler import BS, CT, Cached, NewReq, Out, Req


class FakeTier:
    """Holds ``chunks`` leading chunks of every prompt and answers at once
    (``lookup``, for subclasses to override); records calls."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.calls: list[tuple[str, int]] = []

    def lookup(self, request_id: str, token_ids: list[int], identity: KeyIdentity) -> int:
        self.calls.append((request_id, len(token_ids)))
        return min(self.chunks, len(token_ids) // CT)

    def ask(
        self, request_id: str, token_ids: list[int], identity: KeyIdentity, wait_s: float
    ) -> int | None:
        return self.lookup(request_id, token_ids, identity)

    def asked_at(self, request_id: str) -> float | None:
        return None  # NOTE: answers at once: nothing in flight

    def cancel(self, request_id: str) -> bool:
        return False

    def poll(self) -> list[str]:
        return []

    def table_sizes(self) -> dict[str, int]:
        return {}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sched(tier: FakeTier | None, *, produce: bool = True, consume: bool = True, **kw: Any):
    config = ConnectorConfig(chunk_tokens=CT, lease_ms=10_000)
    return FabricScheduler(config, BS, produce=produce, consume=consume, tier=tier, **kw)


def test_store_hit_beyond_the_local_prefix_loads_synchronously() -> None:
    tier = FakeTier(chunks=3)
    s = sched(tier)
    req = Req("r1", list(range(300)))  # 4 full chunks + 44 tokens
    # vLLM's own prefix cache has 1 block (16 tokens): the store adds the rest of 3 chunks
    assert s.get_num_new_matched_tokens(req, 16) == (3 * CT - 16, False)
    assert tier.calls == [("r1", 256)]  # full chunks only, the last token excluded
    blocks = list(range(50, 69))
    s.update_state_after_alloc(req, blocks, 3 * CT - 16)
    meta = s.build_connector_meta(Out([NewReq("r1", (blocks,), 3 * CT)], Cached(), {"r1": 108}))
    [load] = meta.local_loads
    assert (load.req_id, load.first_block, load.num_chunks) == ("r1", 1, 3)
    assert load.block_ids == blocks[1:12]
    assert not meta.releases


def test_the_last_prompt_token_is_never_a_hit() -> None:
    tier = FakeTier(chunks=10)
    s = sched(tier)
    req = Req("r1", list(range(2 * CT)))  # exactly 2 chunks: only chunk 0 usable
    assert s.get_num_new_matched_tokens(req, 0) == (CT, False)
    assert tier.calls == [("r1", CT)]


def test_short_prompts_and_local_hits_skip_the_lookup() -> None:
    tier = FakeTier(chunks=10)
    s = sched(tier)
    assert s.get_num_new_matched_tokens(Req("r1", list(range(CT))), 0) == (0, False)
    assert s.get_num_new_matched_tokens(Req("r2", list(range(200))), 3 * CT) == (0, False)
    assert tier.calls == []


def test_waiting_request_is_looked_up_once_until_its_hold_could_expire() -> None:
    tier, clock = FakeTier(chunks=2), Clock()
    s = sched(tier, clock=clock)
    req = Req("r1", list(range(300)))
    for _ in range(3):  # no blocks yet: vLLM asks every step
        assert s.get_num_new_matched_tokens(req, 0) == (2 * CT, False)
    assert len(tier.calls) == 1
    clock.now = 6.0  # past half the 10 s lease: hold again
    s.get_num_new_matched_tokens(req, 0)
    assert len(tier.calls) == 2


def test_a_hold_vllm_did_not_use_is_released() -> None:
    s = sched(FakeTier(chunks=2))
    req = Req("r1", list(range(300)))
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, list(range(19)), 0)  # scheduled without the hit
    assert s.build_connector_meta(Out()).releases == ["r1"]
    req2 = Req("r2", list(range(300)))
    s.get_num_new_matched_tokens(req2, 0)
    s.request_finished(req2)  # aborted while waiting
    assert s.build_connector_meta(Out()).releases == ["r2"]


def test_computed_full_chunks_are_saved_without_a_push() -> None:
    s = sched(FakeTier(chunks=0))
    req = Req("r1", list(range(150)))  # 2 full chunks + 22 tokens
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, [], 0)
    blocks = list(range(10))
    meta = s.build_connector_meta(Out([NewReq("r1", (blocks,), 0)], Cached(), {"r1": 150}))
    [plan] = meta.sends
    assert (plan.transfer_id, plan.endpoint, plan.chunk_blocks) == (None, None, [4, 4])
    assert len(plan.token_ids) == 2 * CT
    assert [(c.index, c.block_ids) for c in meta.packs] == [(0, blocks[:4]), (1, blocks[4:8])]
    assert s.request_finished(req) == (False, None)  # save only: no kv_transfer_params


def test_prefiller_with_a_store_hit_still_pushes_every_chunk() -> None:
    s = sched(FakeTier(chunks=1), consume=False)
    params = {"do_remote_decode": True, "transfer_id": "t1", "decode_kv_endpoint": "tcp://x:1"}
    req = Req("r1", list(range(150)), params)
    assert s.get_num_new_matched_tokens(req, 0) == (CT, False)
    blocks = list(range(10))
    s.update_state_after_alloc(req, blocks, CT)
    meta = s.build_connector_meta(Out([NewReq("r1", (blocks,), CT)], Cached(), {"r1": 86}))
    assert [p.transfer_id for p in meta.sends] == ["t1"]
    assert [c.index for c in meta.packs] == [0, 1, 2]  # chunk 0 comes from the store
    assert len(meta.local_loads) == 1
    assert s.request_finished(req)[1]["transfer_id"] == "t1"


def test_remote_prefill_requests_never_ask_the_store() -> None:
    tier = FakeTier(chunks=5)
    s = sched(tier, produce=False)
    params = {"do_remote_prefill": True, "transfer_id": "t1", "num_tokens": 300}
    assert s.get_num_new_matched_tokens(Req("r1", list(range(300)), params), 0) == (300, True)
    assert tier.calls == []


def test_no_tier_means_no_lookup_and_no_save() -> None:
    s = sched(None)
    req = Req("r1", list(range(300)))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, [], 0)
    meta = s.build_connector_meta(Out([NewReq("r1", (list(range(19)),), 0)], Cached(), {"r1": 300}))
    assert not meta.sends and not meta.packs


# ---------------------------------------------------------------- answers across steps
class ScriptedTier(FakeTier):
    """A tier whose lookups stay in flight until the test answers them
    (``answers[rid] = chunks``); ``late``: what ``poll`` reports next."""

    def __init__(self) -> None:
        super().__init__(0)
        self.answers: dict[str, int] = {}
        self.pending: set[str] = set()
        self.cancelled: list[str] = []
        self.late: list[str] = []

    def ask(
        self, request_id: str, token_ids: list[int], identity: KeyIdentity, wait_s: float
    ) -> int | None:
        if request_id not in self.pending:
            self.calls.append((request_id, len(token_ids)))
        if request_id in self.answers:
            self.pending.discard(request_id)
            return self.answers.pop(request_id)
        self.pending.add(request_id)
        return None

    def cancel(self, request_id: str) -> bool:
        if request_id not in self.pending:
            return False
        self.pending.discard(request_id)
        self.cancelled.append(request_id)
        return True

    def poll(self) -> list[str]:
        late, self.late = self.late, []
        return late

    def table_sizes(self) -> dict[str, int]:
        return {"scheduler_lookups": len(self.pending)}


def test_a_lookup_in_flight_is_asked_again_not_sent_again() -> None:
    tier = ScriptedTier()
    s = sched(tier)
    req = Req("r1", list(range(300)))
    for _ in range(3):  # vLLM skips r1 and asks again each step
        assert s.get_num_new_matched_tokens(req, 16) == (None, False)
        s.build_connector_meta(Out())
    assert s.table_sizes()["scheduler_lookups"] == 1
    tier.answers["r1"] = 3
    assert s.get_num_new_matched_tokens(req, 16) == (3 * CT - 16, False)
    assert tier.calls == [("r1", 256)]
    assert s.table_sizes()["scheduler_lookups"] == 0


def test_a_request_that_ends_or_is_scheduled_while_asked_is_released_at_once() -> None:
    tier = ScriptedTier()
    s = sched(tier)
    ended, scheduled = Req("ended", list(range(300))), Req("scheduled", list(range(300)))
    assert s.get_num_new_matched_tokens(ended, 0) == (None, False)
    assert s.get_num_new_matched_tokens(scheduled, 0) == (None, False)
    s.request_finished(ended)
    s.update_state_after_alloc(scheduled, list(range(19)), 0)  # vLLM went on without it
    assert tier.cancelled == ["ended", "scheduled"]
    assert s.build_connector_meta(Out()).releases == ["ended", "scheduled"]
    assert s.table_sizes()["scheduler_lookups"] == 0


def test_a_late_hold_is_released_unless_its_request_loads_a_newer_one() -> None:
    tier = ScriptedTier()
    s = sched(tier)
    loading, missed = Req("loading", list(range(300))), Req("missed", list(range(300)))
    tier.answers |= {"loading": 2, "missed": 0}
    assert s.get_num_new_matched_tokens(loading, 0) == (2 * CT, False)
    assert s.get_num_new_matched_tokens(missed, 0) == (0, False)
    s.update_state_after_alloc(loading, list(range(19)), 2 * CT)
    # answers that came late for lookups of these requests given up on earlier
    tier.late = ["loading", "missed", "gone"]
    meta = s.build_connector_meta(Out())
    assert [load.req_id for load in meta.local_loads] == ["loading"]
    assert meta.releases == ["missed", "gone"]  # loading's hold is the one it loads now


def test_a_hit_refreshed_before_its_lease_ends_waits_for_the_answer() -> None:
    tier, clock = ScriptedTier(), Clock()
    s = sched(tier, clock=clock)
    req = Req("r1", list(range(300)))
    tier.answers["r1"] = 2
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CT, False)
    clock.now = 6.0  # past half the 10 s lease: hold again
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    tier.answers["r1"] = 1  # fewer chunks now
    assert s.get_num_new_matched_tokens(req, 0) == (CT, False)
    clock.now = 12.0
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    s.request_finished(req)  # ends with its refresh in flight
    assert s.build_connector_meta(Out()).releases == ["r1"]  # once
    assert tier.cancelled == ["r1"]


def test_requests_vllm_reads_no_cache_for_are_not_looked_up() -> None:
    tier = FakeTier(chunks=3)
    s = sched(tier)
    req = Req("r1", list(range(300)))
    req.skip_reading_prefix_cache = True  # type: ignore[attr-defined]
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert tier.calls == []
