"""direct_reads auto: staged or direct per decoder link, by measured cost.

The chooser alone (:class:`~fabric.integrations.vllm.paths.PathChooser`),
then two workers over the loopback plane in vLLM's order of calls per step
(``start_load_kv``, ``wait_for_save``, ``get_finished``:
``vllm/v1/worker/kv_connector_model_runner_mixin.py:77-100``): every push
lands the prefiller's KV whichever path it took, each held request is
reported sent once, and a path made dearer on the prefiller's core stops
being chosen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from fabric.errors import ReservationRefused
from fabric.integrations.vllm import worker as worker_module
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, PackChunk, SendPlan
from fabric.integrations.vllm.paths import DIRECT, MAX_LINKS, STAGED, PathChooser
from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.integrations.vllm.worker import FabricWorker
from fabric.transfer.client import PeerLink

from .test_vllm_worker import BS, CT, wait_results, worker

MIB = 2**20


# ---------------------------------------------------------------- the chooser alone


def measured(chooser: PathChooser, endpoint: str, path: str, cpu_s: float, tail_s: float) -> None:
    """One push of 1 MiB over ``path``: it cost ``cpu_s``, its tail was ``tail_s``."""
    chooser.record(endpoint, path, cpu_s, MIB, tail_s, ok=True)


def test_a_decoder_not_known_to_read_gets_staged_pushes() -> None:
    chooser = PathChooser()
    assert [chooser.choose("e") for _ in range(3)] == [STAGED] * 3
    chooser.set_reads("e", False)
    assert chooser.choose("e") == STAGED


def test_both_paths_are_measured_then_the_cheaper_one_is_taken() -> None:
    chooser = PathChooser(min_pushes=2, explore_every=4)
    chooser.set_reads("e", True)
    first = []
    for _ in range(4):
        path = chooser.choose("e")
        first.append(path)
        measured(chooser, "e", path, 0.010 if path == STAGED else 0.002, 0.01)
    assert first == [DIRECT, STAGED, DIRECT, STAGED]
    # NOTE: pushes 5..12: direct, but every 4th (the 8th, the 12th) explores staged
    after = [chooser.choose("e") for _ in range(8)]
    assert after == [DIRECT, DIRECT, DIRECT, STAGED, DIRECT, DIRECT, DIRECT, STAGED]
    snap = chooser.snapshot()["e"]
    assert snap["choice"] == DIRECT and snap["reads"] is True


def test_the_choice_follows_the_measurements_when_they_change() -> None:
    chooser = PathChooser(min_pushes=1, explore_every=2, alpha=1.0)
    chooser.set_reads("e", True)
    measured(chooser, "e", DIRECT, 0.002, 0.01)
    measured(chooser, "e", STAGED, 0.010, 0.01)
    assert chooser.snapshot()["e"]["choice"] == DIRECT
    measured(chooser, "e", DIRECT, 0.050, 0.01)  # NOTE: READs now cost this side (emulated)
    assert chooser.snapshot()["e"]["choice"] == STAGED
    assert chooser.choose("e") == STAGED  # NOTE: the 1st choice; the 2nd explores


def test_the_cost_is_cpu_for_the_pushs_size_plus_the_tail() -> None:
    """Direct: 1 ms of CPU per MiB, a 200 ms tail; staged: 10 ms per MiB, a
    20 ms tail. For a 4 MiB push staged costs 60 ms against direct's 204;
    for a 64 MiB one, 660 against 264."""
    chooser = PathChooser(min_pushes=1, explore_every=100)
    chooser.set_reads("e", True)
    measured(chooser, "e", DIRECT, 0.001, 0.200)
    measured(chooser, "e", STAGED, 0.010, 0.020)
    assert chooser.choose("e", 4 * MIB) == STAGED
    assert chooser.choose("e", 64 * MIB) == DIRECT
    # NOTE: a few ms of tail do not outweigh the CPU (the rule this replaced did)
    chooser2 = PathChooser(min_pushes=1, explore_every=100, alpha=1.0)
    chooser2.set_reads("e", True)
    measured(chooser2, "e", DIRECT, 0.001, 0.019)
    measured(chooser2, "e", STAGED, 0.004, 0.004)
    assert chooser2.choose("e", 32 * MIB) == DIRECT
    chooser2.tail_weight = 0.0
    measured(chooser2, "e", DIRECT, 0.001, 5.0)
    assert chooser2.choose("e", 1 * MIB) == DIRECT  # NOTE: by CPU alone


def test_failed_or_empty_pushes_add_no_cost_and_links_stay_bounded() -> None:
    chooser = PathChooser(min_pushes=1)
    chooser.set_reads("e", True)
    chooser.record("e", DIRECT, 5.0, MIB, 0.0, ok=False, failed=True)
    assert chooser.snapshot()["e"][DIRECT]["failures"] == 1  # type: ignore[index]
    chooser.record("e", DIRECT, 5.0, MIB, 0.0, ok=False)  # NOTE: its request ended early
    assert chooser.snapshot()["e"][DIRECT]["failures"] == 1  # type: ignore[index]
    chooser.record("e", DIRECT, 0.0, 0, 0.0, ok=True)  # NOTE: the decoder had every chunk
    snap = chooser.snapshot()["e"][DIRECT]
    assert snap["pushes"] == 0 and snap["failures"] == 0  # type: ignore[index]
    assert chooser.snapshot()["e"]["recorded"] == 3
    for i in range(MAX_LINKS + 44):
        chooser.choose(f"endpoint-{i}")
    assert chooser.table_sizes() == {"paths_links": MAX_LINKS}


def test_a_path_that_keeps_failing_is_left_but_to_explore_it() -> None:
    """Offers that always fail (a decoder that refuses them, READs that break
    on the link) would leave direct the less measured path forever: after
    ``max_failures`` in a row it is chosen only to explore it again."""
    chooser = PathChooser(min_pushes=2, explore_every=5, max_failures=2)
    chooser.set_reads("e", True)
    chosen = []
    for _ in range(12):
        path = chooser.choose("e")
        chosen.append(path)
        chooser.record("e", path, 0.001, MIB, 0.01, ok=path == STAGED, failed=path == DIRECT)
    assert chosen[:3] == [DIRECT, DIRECT, STAGED]
    assert chosen[3:] == [STAGED, DIRECT, STAGED, STAGED, STAGED, STAGED, DIRECT, STAGED, STAGED]
    measured(chooser, "e", DIRECT, 0.0001, 0.01)  # NOTE: one that landed ends the run
    assert chooser.snapshot()["e"][DIRECT]["failures"] == 0  # type: ignore[index]


def test_auto_is_accepted_with_any_transport_and_true_still_refuses_tcp() -> None:
    assert ConnectorConfig.from_extra({"transport": "tcp", "direct_reads": "auto"}).direct_reads
    with pytest.raises(ValueError, match="direct_reads"):
        ConnectorConfig.from_extra({"transport": "tcp", "direct_reads": True})
    with pytest.raises(ValueError, match="direct_reads"):
        ConnectorConfig.from_extra({"transport": "loopback", "direct_reads": "sometimes"})


# ---------------------------------------------------------------- two workers

SRC = [7, 8, 9, 10, 30, 31, 1, 2, 3, 4]
DST = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
TOKENS = 150  # chunks of 4, 4, 2 blocks


def prompt(n: int, num_tokens: int = TOKENS) -> list[int]:
    """Request ``n``'s prompt: new to the decoder's store (its chunks move)."""
    return [1000 * n + i for i in range(num_tokens)]


@pytest.fixture
def pair() -> Iterator[tuple[FabricWorker, FabricWorker]]:
    p = worker(produce=True, consume=False, seed=1, direct_reads="auto")
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=5, unknown_transfer_grace_s=1)
    yield p, d
    p.shutdown()
    d.shutdown()


def push_one(
    p: FabricWorker,
    d: FabricWorker,
    n: int,
    num_tokens: int = TOKENS,
    before_finish: Callable[[], None] | None = None,
) -> None:
    """Request ``n``: D admitted at dispatch, P computes it in one step and
    vLLM finishes it; its KV lands on D and P reports it sent once, after
    vLLM finished it (``before_finish``: run between P's step and that)."""
    assert d.node is not None
    rid, tid = f"p{n}", f"t{n}"
    counts = chunk_block_counts(num_tokens, CT, BS)
    packs, start = [], 0
    for index, count in enumerate(counts):
        packs.append(PackChunk(rid, index, SRC[start : start + count]))
        start += count
    sends = [SendPlan(rid, tid, d.node.endpoint, prompt(n, num_tokens), counts, hold=True)]
    load = LoadPlan(f"d{n}", tid, 0, DST, num_tokens, prompt(n, num_tokens))
    d.start_load(FabricMetadata(loads=[load]))
    meta = FabricMetadata(sends=sends, packs=packs)
    p.start_load(meta)
    p.pack_step(meta)
    p.before_step()
    p.get_results(set())
    sent = p.take_sent()
    if before_finish is not None:
        before_finish()
    assert wait_results(d) == ({f"d{n}"}, set()), n
    blocks = -(-num_tokens // BS)
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for b in range(blocks):
            assert torch.equal(d_layer[DST[b]], p_layer[SRC[b]]), (n, b)
    # NOTE: vLLM finishes it in the next step; reported sent once
    p.start_load(FabricMetadata())
    p.before_step()
    p.get_results({rid})
    deadline = time.monotonic() + 10
    while rid not in sent and time.monotonic() < deadline:
        p.get_results(set())
        sent |= p.take_sent()
        time.sleep(0.005)
    assert sent == {rid}, n
    p.get_results(set())
    assert p.take_sent() == set()


def wait_jobs_over(p: FabricWorker, recorded: int | None = None) -> None:
    """Until P's pushes are over and (``recorded``) that many were recorded
    on its one link (a push is recorded at the end of its link thread's
    round, after it was dropped)."""
    assert p.sender is not None and p.paths is not None
    deadline = time.monotonic() + 10
    while p.sender.table_sizes()["sender_jobs"] and time.monotonic() < deadline:
        time.sleep(0.005)
    while recorded is not None and time.monotonic() < deadline:
        links = p.paths.snapshot()
        if sum(int(link["recorded"]) for link in links.values()) >= recorded:  # type: ignore[call-overload]
            return
        time.sleep(0.005)


def run_pushes(
    p: FabricWorker, d: FabricWorker, count: int, num_tokens: int = TOKENS
) -> tuple[list[str], dict[str, int]]:
    """``count`` requests: the path each took, and P's counters over all."""
    paths: list[str] = []
    totals: dict[str, int] = {}
    for n in range(count):
        push_one(p, d, n, num_tokens)
        wait_jobs_over(p, recorded=n + 1)
        counts = p.counters.take()
        took = [path for path in (DIRECT, STAGED) if counts.get(f"pushes_{path}")]
        assert len(took) == 1, (n, counts)
        paths.append(took[0])
        for name, value in counts.items():
            if isinstance(value, int):
                totals[name] = totals.get(name, 0) + value
    return paths, totals


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_auto_measures_both_paths_and_keeps_the_cheaper_one(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """The first push is staged (the decoder's reads are known from its
    HelloAck only), then the less measured path goes until each was
    measured twice; then the one cheaper on P's threads (here the two are
    close: either). Every push lands P's KV, and each held request is
    reported sent once, staged ones too."""
    p, d = pair
    assert p.paths is not None
    paths, counters = run_pushes(p, d, 8)
    assert paths[:4] == [STAGED, DIRECT, DIRECT, STAGED], paths
    assert d.node is not None
    link = p.paths.snapshot()[d.node.endpoint]
    assert link["reads"] is True
    assert link[DIRECT]["pushes"] == paths.count(DIRECT)  # type: ignore[index]
    assert link[STAGED]["pushes"] == paths.count(STAGED)  # type: ignore[index]
    assert counters["holds_released"] == 8
    assert counters.get("chunks_offered", 0) == 3 * paths.count(DIRECT)
    assert p.own_table_sizes()["worker_holding"] == 0
    assert p.own_table_sizes()["worker_measured"] == 0


@pytest.mark.parametrize("dearer", [DIRECT, STAGED])
def test_auto_turns_away_from_the_path_made_dearer_on_the_prefillers_core(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch, dearer: str
) -> None:
    """Each direct push's in-place hash (or each staged push's pack) burns
    20 ms more of the pack thread's CPU: after both were measured, the
    other path is chosen, whichever it is."""
    p, d = pair
    if dearer == DIRECT:
        real_hash = worker_module.checksum_spans

        def slow_hash(*args: object, **kw: object) -> int:
            burn(0.02)
            return real_hash(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(worker_module, "checksum_spans", slow_hash)
    else:
        real_pack = FabricWorker._pack_into

        def slow_pack(self: FabricWorker, *args: object, **kw: object) -> int:
            burn(0.02)
            return real_pack(self, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(FabricWorker, "_pack_into", slow_pack)
    assert p.paths is not None
    p.paths.tail_weight = 0.0  # NOTE: by CPU alone (tails on a loaded machine vary)
    paths, _ = run_pushes(p, d, 9)
    cheaper = STAGED if dearer == DIRECT else DIRECT
    assert paths[:4] == [STAGED, DIRECT, DIRECT, STAGED], paths
    assert paths[4:] == [cheaper] * 5, paths
    assert p.paths is not None and d.node is not None
    assert p.paths.snapshot()[d.node.endpoint]["choice"] == cheaper


def test_auto_pushes_staged_to_a_decoder_that_does_not_read(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """A decoder whose HelloAck says it reads no offers (an older fabric, a
    data plane that cannot read) is never offered a chunk."""
    p, d = pair
    assert d.node is not None and d.node.server is not None
    d.node.server._read_layout = None  # NOTE: as a receiver that does not read
    paths, counters = run_pushes(p, d, 4)
    assert paths == [STAGED] * 4
    assert counters.get("chunks_offered", 0) == 0 and counters["holds_released"] == 4


def test_auto_counts_the_link_threads_cpu_of_a_pushs_last_step(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """READs a decoder emulates with messages cost the prefiller's link
    thread inside its offer: made 20 ms per offer here, on one-chunk
    prompts (the offer that ends the push is its only one: a cost counted
    after the push was recorded would be lost, and direct would look free)."""
    p, d = pair
    real_offer = PeerLink.offer_many  # NOTE: every offer goes through it

    def dear_offer(self: PeerLink, *args: object, **kw: object) -> None:
        burn(0.02)
        real_offer(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(PeerLink, "offer_many", dear_offer)
    assert p.paths is not None
    p.paths.tail_weight = 0.0  # NOTE: the choice by CPU alone (the offer lengthens the tail)
    paths, _ = run_pushes(p, d, 8, num_tokens=CT)
    assert paths[:4] == [STAGED, DIRECT, DIRECT, STAGED], paths
    assert paths[4:] == [STAGED] * 4, paths


def test_auto_leaves_a_path_whose_offers_are_refused(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Offer refused on this link: two direct pushes fail (D recomputes
    those), then the pushes are staged and land, but to explore direct again."""
    p, d = pair
    assert d.node is not None

    def refused(self: PeerLink, *args: object, **kw: object) -> None:
        raise ReservationRefused("bad_request: this receiver does not read offered chunks")

    monkeypatch.setattr(PeerLink, "offer_many", refused)  # NOTE: every offer goes through it
    outcomes = []
    for n in range(7):
        try:
            push_one(p, d, n)
            outcomes.append("landed")
        except AssertionError:
            outcomes.append("failed")
        wait_jobs_over(p, recorded=n + 1)
    assert outcomes[:3] == ["landed", "failed", "failed"], outcomes  # NOTE: staged, then direct
    assert outcomes[3:] == ["landed"] * 4, outcomes
    assert p.paths is not None
    link = p.paths.snapshot()[d.node.endpoint]
    assert link[DIRECT]["failures"] == 2 and link[STAGED]["pushes"] == 5  # type: ignore[index]


def test_a_direct_push_keeps_its_blocks_held_until_its_offers_ended(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM frees a held request's blocks at the report: a direct push (here
    the second, auto's first direct one) is not reported sent while an offer
    of its blocks is still waiting for the decoder's READ."""
    p, d = pair
    push_one(p, d, 0)  # NOTE: staged (D's reads are not known yet)
    wait_jobs_over(p, recorded=1)
    gate = threading.Event()
    waiting = threading.Event()
    real_offer = PeerLink.offer_many  # NOTE: every offer goes through it

    def gated_offer(self: PeerLink, *args: object, **kw: object) -> None:
        waiting.set()
        assert gate.wait(10)
        real_offer(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(PeerLink, "offer_many", gated_offer)

    def finished_while_offer_waits() -> None:
        assert waiting.wait(10)
        p.start_load(FabricMetadata())
        p.before_step()
        p.get_results({"p1"})  # NOTE: vLLM finished it; its blocks are held
        time.sleep(0.2)
        p.get_results(set())
        assert p.take_sent() == set()  # NOTE: an offer still waits: not freed yet
        gate.set()

    push_one(p, d, 1, before_finish=finished_while_offer_waits)
    counters = p.counters.take()
    assert counters.get("pushes_direct") == 1 and counters.get("chunks_offered") == 3
