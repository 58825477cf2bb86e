"""direct_reads between two workers (no vLLM engine): the prefiller hashes
each computed chunk in its blocks and offers it, the decoder READs it into
its store and loads it as a pushed chunk; vLLM keeps the prefiller's blocks
until its worker reports the request sent, exactly once.

Loopback data plane, small CPU caches; vLLM's order of calls per step
(``start_load_kv``, ``wait_for_save``, ``get_finished``) as in
``vllm/v1/worker/kv_connector_model_runner_mixin.py:77-100``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from fabric.errors import ConfigError
from fabric.integrations.vllm import worker as worker_module
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, PackChunk, SendPlan
from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.integrations.vllm.worker import FabricWorker
from fabric.transfer import PeerLink
from fabric.transfer.client import ChunkOffer

from .test_vllm_worker import BS, CT, tokens, wait_results, worker

SRC = [7, 8, 9, 10, 30, 31, 1, 2, 3, 4]
DST = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]


@pytest.fixture
def pair() -> Iterator[tuple[FabricWorker, FabricWorker]]:
    p = worker(produce=True, consume=False, seed=1, direct_reads=True)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=3, unknown_transfer_grace_s=0.5)
    yield p, d
    p.shutdown()
    d.shutdown()


def step(p: FabricWorker, meta: FabricMetadata, finished: set[str] | None = None) -> set[str]:
    """One prefiller step in vLLM's order; what it reports sent."""
    p.start_load(meta)
    p.pack_step(meta)
    p.before_step()  # NOTE: the next step's first hook joins the packing
    p.get_results(finished or set())
    return p.take_sent()


def prefill(num_tokens: int, endpoint: str, *, hold: bool = True) -> FabricMetadata:
    counts = chunk_block_counts(num_tokens, CT, BS)
    packs, start = [], 0
    for index, n in enumerate(counts):
        packs.append(PackChunk("p-req", index, SRC[start : start + n]))
        start += n
    sends = [SendPlan("p-req", "t1", endpoint, tokens(num_tokens), counts, hold=hold)]
    return FabricMetadata(sends=sends, packs=packs)


def sent_within(p: FabricWorker, timeout: float = 10) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p.get_results(set())
        sent = p.take_sent()
        if sent:
            return sent
        time.sleep(0.01)
    return set()


def assert_read(p: FabricWorker, d: FabricWorker, num_tokens: int) -> None:
    """The decoder's blocks ``DST`` hold the KV of the prefiller's ``SRC`` (the prompt's)."""
    src = SRC[: -(-num_tokens // BS)]
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for b in range(len(src)):
            assert torch.equal(d_layer[DST[b]], p_layer[src[b]]), b


def released(p: FabricWorker) -> set[str]:
    """vLLM finished ``p-req`` (named in the next step): what is reported sent."""
    return step(p, FabricMetadata(), {"p-req"}) or sent_within(p)


@pytest.mark.parametrize("first_block", [0, 2, 5])
def test_direct_reads_land_the_prefillers_kv_and_release_its_blocks_once(
    pair: tuple[FabricWorker, FabricWorker], first_block: int
) -> None:
    p, d = pair
    assert d.node is not None
    num_tokens = 150  # chunks of 4, 4, 2 blocks
    plan = LoadPlan("d-req", "t1", first_block, DST[first_block:], num_tokens, tokens(num_tokens))
    d.start_load(FabricMetadata(loads=[plan]))  # NOTE: admitted at dispatch
    assert step(p, prefill(num_tokens, d.node.endpoint)) == set()  # NOTE: not finished yet
    assert wait_results(d) == ({"d-req"}, set())
    src = SRC[: -(-num_tokens // BS)]
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for b in range(first_block, len(src)):
            assert torch.equal(d_layer[DST[b]], p_layer[src[b]]), b
    assert p.store.stats().filled == 0  # NOTE: nothing packed on the prefiller
    assert released(p) == {"p-req"}
    assert step(p, FabricMetadata()) == set()  # NOTE: reported once
    pc, dc = p.counters.take(), d.counters.take()
    assert pc["chunks_offered"] == 3 and pc["holds_released"] == 1
    assert dc["loads_ok"] == 1
    assert d.node.server is not None and d.node.server.stats.chunks_read == 3
    assert p.own_table_sizes()["worker_holding"] == 0


def test_a_hold_is_reported_only_after_vllm_finished_the_request(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """vLLM asserts a request it is told sent has finished (it frees its
    blocks): a push over before ``request_finished`` waits for it."""
    p, d = pair
    assert d.node is not None
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST[:4], 64, tokens(64))]))
    step(p, prefill(64, d.node.endpoint))
    assert wait_results(d) == ({"d-req"}, set())
    time.sleep(0.2)
    assert sent_within(p, timeout=0.3) == set()
    assert released(p) == {"p-req"}


def test_blocks_reused_before_the_read_fail_the_load_not_the_tokens(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block the prefiller's vLLM reused after the chunk was hashed (a
    preemption, a hold given up) reaches the decoder changed: its checksum
    fails, the load fails (vLLM recomputes), and the hold is still released."""
    p, d = pair
    assert d.node is not None
    real = worker_module.checksum_spans

    def then_reuse(*args: object, **kw: object) -> int:
        checksum = real(*args, **kw)  # type: ignore[arg-type]
        p.kv_caches[1][SRC[2]] += 1  # NOTE: another request writes the block now
        return checksum

    monkeypatch.setattr(worker_module, "checksum_spans", then_reuse)
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST[:4], 64, tokens(64))]))
    step(p, prefill(64, d.node.endpoint))
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    assert d.node.server is not None and d.node.server.stats.checksum_failures == 1
    assert released(p) == {"p-req"}


def test_a_failed_push_and_an_early_finish_still_release_the_hold(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    p, d = pair
    assert d.node is not None
    # the decoder is gone: the Reserve fails, nothing is read
    meta = prefill(64, "tcp://127.0.0.1:9")
    step(p, meta)
    assert released(p) == {"p-req"}
    # finished after its first chunk of three: the push fails, the hold ends
    d.start_load(FabricMetadata(loads=[LoadPlan("d2", "t1", 0, DST, 150, tokens(150))]))
    meta = prefill(150, d.node.endpoint)
    first = FabricMetadata(sends=meta.sends, packs=meta.packs[:1])
    step(p, first)
    assert released(p) == {"p-req"}
    assert wait_results(d) == ({"d2"}, {"d2"})


def test_a_request_not_held_is_never_reported_sent(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """vLLM frees an unheld request's blocks itself: naming it sent would
    trip its assert (``scheduler.py:3233``)."""
    p, d = pair
    assert d.node is not None
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST[:4], 64, tokens(64))]))
    step(p, prefill(64, d.node.endpoint, hold=False))
    assert wait_results(d) == ({"d-req"}, set())
    assert step(p, FabricMetadata(), {"p-req"}) == set()
    assert sent_within(p, timeout=0.5) == set()


def test_an_idle_step_waits_for_the_readers_instead_of_spinning(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """While only held requests remain vLLM steps without tokens back to back;
    each such step waits for a push to end (at most ``IDLE_STEP_WAIT_S``)."""
    p, _ = pair
    step(p, prefill(64, "tcp://127.0.0.1:9"))
    with p._holds:  # NOTE: a push still being read
        p._held_finished.add("p-req")
        over = set(p._held_over)
        p._held_over.clear()
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < 0.5:
        p.get_results(set(), idle=True)
        steps += 1
    assert steps <= 0.5 / worker_module.IDLE_STEP_WAIT_S + 2
    with p._holds:
        p._held_over |= over | {"p-req"}
    assert p.take_sent() == {"p-req"}


def test_direct_reads_refuse_a_transport_that_cannot_read() -> None:
    with pytest.raises(ValueError, match="direct_reads"):
        ConnectorConfig.from_extra({"transport": "tcp", "direct_reads": True})
    config = ConnectorConfig.from_extra({"transport": "loopback", "direct_reads": True})
    assert config.direct_reads
    real = worker(produce=True, consume=False, seed=3)
    try:
        w = FabricWorker(config, produce=True, consume=False, block_size=BS, model="tiny")
        w.kv_caches = [torch.zeros(1, device="meta")]
        w.node = real.node
        with pytest.raises(ConfigError, match="host memory"):
            w._register_cache(None)  # type: ignore[arg-type]
    finally:
        real.shutdown()


def test_a_chunk_that_waited_too_long_to_be_offered_gives_the_blocks_back(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """vLLM keeps the blocks until the push is over: a chunk that waited
    ``push_timeout_s`` to be offered (a receiver slow to answer) fails the
    push rather than hold them longer."""
    p, d = pair
    assert d.node is not None and p.sender is not None
    p.sender.push_timeout_s = 0.0
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST[:4], 64, tokens(64))]))
    step(p, prefill(64, d.node.endpoint))
    assert released(p) == {"p-req"}
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    assert p.counters.take()["push_failures"] == 1


def test_a_held_request_whose_load_vllm_frees_is_not_reported_sent() -> None:
    """Aborted while it waited for a load of its own (vLLM then frees its
    blocks when the load is reported, ``scheduler.py:3226-3229``): naming it
    in ``finished_sending`` too would trip vLLM's assert (:3233)."""
    both = worker(
        produce=True,
        consume=True,
        seed=5,
        direct_reads=True,
        unknown_transfer_grace_s=0.2,
    )
    try:
        step(both, prefill(64, "tcp://127.0.0.1:9"))  # NOTE: its push fails: over
        both.start_load(
            FabricMetadata(loads=[LoadPlan("p-req", "nobody", 0, DST[:4], 64, tokens(64))])
        )
        recving: set[str] = set()
        sent: set[str] = set()
        deadline = time.monotonic() + 15
        finished = {"p-req"}  # NOTE: vLLM aborted it (named once, the next step)
        while not recving and time.monotonic() < deadline:
            recving |= both.get_results(finished)[0]
            finished = set()
            sent |= both.take_sent()
            time.sleep(0.01)
        assert recving == {"p-req"}
        # NOTE: its push is over once its Hello times out (5 s): still not sent
        assert both.sender is not None
        while time.monotonic() < deadline and both.sender.table_sizes()["sender_jobs"]:
            both.get_results(set())
            sent |= both.take_sent()
            time.sleep(0.05)
        both.get_results(set())
        assert sent | both.take_sent() == set()
        assert both.own_table_sizes()["worker_holding"] == 0
    finally:
        both.shutdown()


def test_layer_groups_are_read_during_the_forward_and_the_decoder_gets_the_final_kv(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """With layer groups, each group of a chunk is hashed and offered once its
    layers' hooks ran (``save_kv_layer``, the forward still computing the
    rest), and the decoder reads and unpacks it then; the last group is
    offered at ``wait_for_save`` with the chunk's checksum. The forward is
    simulated as in ``test_vllm_layered``: every layer of the step's blocks
    holds stale bytes until its attention writes them right before its
    hook, so a group read before its hook would land stale KV."""
    p, d = pair
    assert d.node is not None and d.node.server is not None and p.layered is not None
    num_tokens = 150
    src = SRC[: -(-num_tokens // BS)]
    d.start_load(
        FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST, num_tokens, tokens(num_tokens))])
    )
    meta = prefill(num_tokens, d.node.endpoint)
    names = list(p._named_caches)
    g = torch.Generator().manual_seed(99)
    new = [torch.randn(len(src), *c.shape[1:], generator=g).to(c.dtype) for c in p.kv_caches]
    p.before_step()
    p.start_load(meta)
    server = d.node.server
    for i, name in enumerate(names[:-1]):  # NOTE: the forward up to its last layer
        p.kv_caches[i][src] = new[i]
        p.pack_layer(name, meta)
    p.flush()
    deadline = time.monotonic() + 5
    parts = 3 * (len(names) - 1)  # NOTE: 3 chunks, a group per layer but the last
    while server.stats.parts_read < parts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats.parts_read == parts and server.stats.chunks_read == 0
    deadline = time.monotonic() + 5
    while d.get_results(set()) == (set(), set()) and time.monotonic() < deadline:
        # NOTE: the decoder unpacks the groups that landed (its loader's steps)
        layer = d.kv_caches[len(names) - 2]
        if torch.equal(layer[DST[: len(src)]], new[len(names) - 2]):
            break
        time.sleep(0.01)
    assert torch.equal(d.kv_caches[len(names) - 2][DST[: len(src)]], new[len(names) - 2])
    assert not torch.equal(d.kv_caches[-1][DST[: len(src)]], new[-1])  # NOTE: not computed yet
    p.kv_caches[-1][src] = new[-1]
    p.pack_layer(names[-1], meta)
    p.pack_step(meta)
    p.before_step()
    p.get_results(set())
    assert wait_results(d) == ({"d-req"}, set())
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        assert torch.equal(d_layer[DST[: len(src)]], p_layer[src])
    assert server.stats.chunks_read == 3 and server.stats.checksum_failures == 0
    assert p.store.stats().filled == 0  # NOTE: nothing packed on the prefiller
    assert released(p) == {"p-req"}
    pc, dc = p.counters.take(), d.counters.take()
    assert (pc["parts_offered"], pc["chunks_offered"]) == (parts, 3)
    assert dc["chunks_streamed"] == 3 and dc.get("streams_redone", 0) == 0
    assert p.table_sizes()["worker_layered_hashes"] == 0


def test_parts_of_a_chunk_the_decoder_has_are_not_counted_as_chunks(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """A prompt whose first chunk the decoder holds already (a shared prefix):
    its layer groups are hashed and offered like the others' (the prefiller
    does not know), and must not count as chunks sent: eight groups counted
    as eight chunks ended the push early, its last chunks never offered
    (the load waited out its timeout)."""
    p, d = pair
    assert d.node is not None and d.node.server is not None and p.layered is not None
    src, dst = list(range(0, 16)), list(range(20, 36))
    d.start_load(FabricMetadata(loads=[LoadPlan("d1", "t1", 0, dst, 64, tokens(64))]))
    forward_step(p, "r1", "t1", d.node.endpoint, 64, src, hooks=False)
    assert wait_results(d) == ({"d1"}, set())
    assert step(p, FabricMetadata(), {"r1"}) == {"r1"} or sent_within(p) == {"r1"}
    p.counters.take()
    n = 4 * CT  # NOTE: chunk 0 is present at the decoder
    d.start_load(FabricMetadata(loads=[LoadPlan("d2", "t2", 0, dst, n, tokens(n))]))
    forward_step(p, "r2", "t2", d.node.endpoint, n, src, hooks=True)
    assert wait_results(d) == ({"d2"}, set())
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        assert torch.equal(d_layer[dst], p_layer[src])
    pc = p.counters.take()
    assert pc.get("push_failures", 0) == 0 and pc["chunks_offered"] == 3
    assert pc["parts_offered"] == 3 * (len(p.kv_caches) - 1)  # NOTE: none for chunk 0


def forward_step(
    p: FabricWorker, rid: str, tid: str, endpoint: str, n: int, src: list[int], *, hooks: bool
) -> None:
    """One prefill step of ``n`` tokens in blocks ``src``, its layer hooks run
    (the KV as it is) when ``hooks``."""
    counts = chunk_block_counts(n, CT, BS)
    packs, start = [], 0
    for index, c in enumerate(counts):
        packs.append(PackChunk(rid, index, src[start : start + c]))
        start += c
    meta = FabricMetadata(
        sends=[SendPlan(rid, tid, endpoint, tokens(n), counts, hold=True)], packs=packs
    )
    p.before_step()
    p.start_load(meta)
    if hooks:
        for name in list(p._named_caches):
            p.pack_layer(name, meta)
    p.pack_step(meta)
    p.before_step()
    p.get_results(set())


def test_offers_queued_while_one_is_answered_go_as_one_round_trip(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pack thread offers a step's chunks one after another; those queued
    while the push thread waits for an answer (here its Reserve's) go
    together (``PeerLink.offer_many``: one round trip, each read as it
    comes), and the decoder gets every chunk's KV."""
    p, d = pair
    assert d.node is not None and p.sender is not None
    calls: list[list[int]] = []
    real_offer_many, real_reserve = PeerLink.offer_many, PeerLink.reserve

    def reserve(link: PeerLink, *args: object, **kwargs: object) -> object:
        queued = p.sender._peers[d.node.endpoint].events  # type: ignore[union-attr]
        deadline = time.monotonic() + 10  # NOTE: answered once the three offers wait behind it
        while queued.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        return real_reserve(link, *args, **kwargs)  # type: ignore[arg-type]

    def offer_many(link: PeerLink, res: object, offers: list[ChunkOffer], cache: object) -> None:
        calls.append([o.index for o in offers])
        real_offer_many(link, res, offers, cache)  # type: ignore[arg-type]

    monkeypatch.setattr(PeerLink, "reserve", reserve)
    monkeypatch.setattr(PeerLink, "offer_many", offer_many)
    num_tokens = 150  # chunks of 4, 4, 2 blocks
    plan = LoadPlan("d-req", "t1", 0, DST, num_tokens, tokens(num_tokens))
    d.start_load(FabricMetadata(loads=[plan]))
    step(p, prefill(num_tokens, d.node.endpoint))
    assert wait_results(d) == ({"d-req"}, set())
    assert calls == [[0, 1, 2]]
    assert_read(p, d, num_tokens)
    assert released(p) == {"p-req"}
    pc = p.counters.take()
    assert pc["chunks_offered"] == 3 and pc.get("push_failures", 0) == 0


def test_a_layer_groups_parts_of_a_steps_chunks_go_as_one_round_trip(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pack thread hashes a layer group of each of a step's chunks, then
    offers them as one event: one round trip per group to the decoder (each
    read as it comes), not one per chunk as the push thread wakes. Before,
    each chunk's part was queued right after its hash: with hashes that take
    a while (here 30 ms each), the push thread took the first alone, then
    the others while the first was answered."""
    from fabric.kv import layerwise

    p, d = pair
    assert d.node is not None and p.sender is not None and p.layered is not None
    calls: list[list[tuple[int, int]]] = []
    real_offer_many, real_hash = PeerLink.offer_many, layerwise.LayerwiseHash.hash_layers

    def offer_many(link: PeerLink, res: object, offers: list[ChunkOffer], cache: object) -> None:
        calls.append([(o.index, o.layers) for o in offers])
        real_offer_many(link, res, offers, cache)  # type: ignore[arg-type]

    def slow_hash(hashing: layerwise.LayerwiseHash, upto: int) -> None:
        time.sleep(0.03)
        real_hash(hashing, upto)

    monkeypatch.setattr(PeerLink, "offer_many", offer_many)
    monkeypatch.setattr(layerwise.LayerwiseHash, "hash_layers", slow_hash)
    num_tokens = 150  # chunks of 4, 4, 2 blocks
    d.start_load(
        FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST, num_tokens, tokens(num_tokens))])
    )
    meta = prefill(num_tokens, d.node.endpoint)
    p.before_step()
    p.start_load(meta)
    for name in p._named_caches:
        p.pack_layer(name, meta)
    p.pack_step(meta)
    p.before_step()
    p.get_results(set())
    assert wait_results(d) == ({"d-req"}, set())
    groups = len(p.kv_caches) - 1  # NOTE: a group per layer; the last one is the final offers
    parts = [call for call in calls if any(layers for _, layers in call)]
    assert parts == [[(i, g) for i in range(3)] for g in range(1, groups + 1)]
    assert sorted(i for call in calls for i, layers in call if not layers) == [0, 1, 2]
    assert_read(p, d, num_tokens)
    assert released(p) == {"p-req"}
    pc = p.counters.take()
    assert (pc["parts_offered"], pc["chunks_offered"]) == (3 * groups, 3)
