"""Layer-wise packing (``layer_groups``): chunks packed while the forward runs.

Driven in vLLM's hook order for one step (``handle_preemptions`` ->
``start_load_kv`` -> the forward, which calls ``save_kv_layer`` after each
attention layer wrote its KV -> ``wait_for_save`` -> ``get_transfer_results``),
with the forward simulated: every layer of the step's blocks holds stale
bytes until "its attention" writes them, right before its hook. A pack that
read a layer before its hook would push the stale bytes; the decoder's
blocks are compared with the prefiller's final ones.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.connector import FabricConnector
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, PackChunk, SendPlan
from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.integrations.vllm.worker import FabricWorker
from fabric.kv import chunk_keys, pack_checksummed
from fabric.kv.layerwise import LayerwisePack, group_ends
from tests.integrations.test_vllm_worker import (
    BLOCKS,
    BS,
    CT,
    LAYERS,
    tokens,
    wait_results,
    worker,
)

layered_module = importlib.import_module("fabric.integrations.vllm.layered")

NUM_TOKENS = 150  # chunks of 4, 4 and 2 blocks
SRC = [7, 8, 9, 10, 30, 31, 1, 2, 3, 4]
DST = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]


@pytest.fixture
def pair() -> Iterator[tuple[FabricWorker, FabricWorker]]:
    p = worker(produce=True, consume=False, seed=1, layer_groups=LAYERS)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=5)
    yield p, d
    p.shutdown()
    d.shutdown()


def step_meta(endpoint: str, req: str = "p-req", transfer: str = "t1") -> FabricMetadata:
    counts = chunk_block_counts(NUM_TOKENS, CT, BS)
    packs, start = [], 0
    for index, n in enumerate(counts):
        packs.append(PackChunk(req, index, SRC[start : start + n]))
        start += n
    sends = [SendPlan(req, transfer, endpoint, tokens(NUM_TOKENS), counts)]
    return FabricMetadata(sends=sends, packs=packs)


def begin_step(
    pair: tuple[FabricWorker, FabricWorker],
) -> tuple[FabricWorker, FabricWorker, FabricMetadata]:
    """The pair, the step's metadata (a push to D), ``before_step`` done."""
    p, d = pair
    assert d.node is not None
    meta = step_meta(d.node.endpoint)
    p.before_step()
    return p, d, meta


def final_kv(p: FabricWorker) -> list[torch.Tensor]:
    """What the forward will write: each layer's step blocks, new values."""
    g = torch.Generator().manual_seed(99)
    return [torch.randn(len(SRC), *c.shape[1:], generator=g).to(c.dtype) for c in p.kv_caches]


def forward(p: FabricWorker, meta: FabricMetadata, order: list[str] | None = None) -> None:
    """The forward: layer i's KV is written, then its ``save_kv_layer`` runs."""
    names = list(p._named_caches)
    new = final_kv(p)
    for name in order or names:
        if name in p._named_caches:
            i = names.index(name)
            p.kv_caches[i][SRC] = new[i]
        p.pack_layer(name, meta)


def run_and_load(p: FabricWorker, d: FabricWorker, meta: FabricMetadata) -> None:
    """The step on P (forward, wait_for_save), then D loads; D holds P's KV."""
    forward(p, meta)
    p.pack_step(meta)
    p.flush()
    load(d)
    assert_same_kv(p, d)


def load(d: FabricWorker) -> None:
    plan = LoadPlan("d-req", "t1", 0, DST, NUM_TOKENS, tokens(NUM_TOKENS))
    d.start_load(FabricMetadata(loads=[plan]))
    assert wait_results(d) == ({"d-req"}, set())


def assert_same_kv(p: FabricWorker, d: FabricWorker) -> None:
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for s, t in zip(SRC, DST, strict=True):
            assert torch.equal(d_layer[t], p_layer[s])


def assert_no_slot_held(p: FabricWorker) -> None:
    sizes = p.table_sizes()
    assert sizes["worker_layered_slots"] == 0
    assert p.store.reserved_count() == 0, sizes


def test_the_chunks_are_packed_during_the_forward_and_the_decoder_gets_the_final_kv(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    p, d, meta = begin_step(pair)
    names = list(p._named_caches)
    new = final_kv(p)
    for i, name in enumerate(names[:-1]):  # NOTE: the forward up to its last layer
        p.kv_caches[i][SRC] = new[i]
        p.pack_layer(name, meta)
    p.flush()
    # NOTE: layers 0 .. LAYERS-2 of every chunk are packed before the step ends
    assert p.layered is not None and len(p.layered._parts) == 3
    for (_, index), (_, part) in p.layered._parts.items():
        assert part.layers_done == LAYERS - 1, index
    p.kv_caches[-1][SRC] = new[-1]
    p.pack_layer(names[-1], meta)
    p.pack_step(meta)
    p.get_results(set())
    p.flush()
    load(d)
    assert_same_kv(p, d)
    assert p.counters.take()["chunks_packed_layerwise"] == 3
    assert_no_slot_held(p)


def test_a_group_is_packed_only_once_every_layer_before_it_was_saved(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """Hooks out of the cache dict's order, and a layer fabric does not know
    (e.g. a draft model's): nothing is packed early, the KV is still right."""
    p, d = pair
    assert d.node is not None
    meta = step_meta(d.node.endpoint)
    names = list(p._named_caches)
    p.before_step()
    new = final_kv(p)
    p.kv_caches[1][SRC] = new[1]
    p.pack_layer(names[1], meta)
    p.pack_layer("draft.layers.0.attn", meta)
    p.flush()
    assert p.layered is not None and not p.layered._parts  # NOTE: layer 0 not saved yet
    for i in (0, 2):
        p.kv_caches[i][SRC] = new[i]
        p.pack_layer(names[i], meta)
    p.pack_step(meta)
    p.flush()
    load(d)
    assert_same_kv(p, d)
    assert_no_slot_held(p)


def test_a_chunk_present_by_the_steps_end_gives_its_slot_back(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """Two requests of one step with the same prompt: both get slots during
    the forward, the first commits, the second pushes the first's chunks."""
    p, d = pair
    assert d.node is not None
    one, two = step_meta(d.node.endpoint), step_meta(d.node.endpoint, "p-req2", "t2")
    meta = FabricMetadata(sends=one.sends + two.sends, packs=one.packs + two.packs)
    free_before = p.store.stats().free
    p.before_step()
    run_and_load(p, d, meta)
    assert_no_slot_held(p)
    assert p.store.stats().free == free_before - 3  # NOTE: 3 chunks kept once, not twice
    assert p.counters.take()["chunks_packed_layerwise"] == 3


def test_a_failed_layer_pack_is_packed_whole_at_the_steps_end(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d = pair
    assert d.node is not None
    calls = {"n": 0}
    real = LayerwisePack.pack_layers

    def flaky(self: LayerwisePack, upto: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        real(self, upto)

    monkeypatch.setattr(LayerwisePack, "pack_layers", flaky)
    meta = step_meta(d.node.endpoint)
    p.before_step()
    run_and_load(p, d, meta)
    counts = p.counters.take()
    assert counts["thread_errors"] == 1 and counts["chunks_packed_layerwise"] == 2
    assert_no_slot_held(p)


def test_a_step_that_never_reached_wait_for_save_gives_its_slots_back(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    p, _, meta = begin_step(pair)
    forward(p, meta)
    p.flush()
    assert p.layered is not None and p.layered._parts
    p.before_step()  # NOTE: the next step
    assert_no_slot_held(p)
    p.get_results({"p-req"})  # NOTE: vLLM names it finished: the push ends too
    p.flush()


def test_without_async_save_the_forward_thread_packs_the_groups() -> None:
    p = worker(produce=True, consume=False, seed=1, layer_groups=2, async_save=False)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=5)
    try:
        assert d.node is not None
        meta = step_meta(d.node.endpoint)
        p.before_step()
        forward(p, meta)
        p.pack_step(meta)
        load(d)
        assert_same_kv(p, d)
        assert p.counters.take()["chunks_packed_layerwise"] == 3
        assert_no_slot_held(p)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("extra", [{"layer_groups": 1}, {"layer_groups": 3, "pack_threads": 2}])
def test_layer_wise_packing_is_off_where_it_does_not_apply(extra: dict[str, int]) -> None:
    p = worker(produce=True, consume=False, seed=1, **extra)
    try:
        assert p.layered is None
        p.pack_layer("layer.0", step_meta("tcp://127.0.0.1:1"))  # NOTE: a no-op
    finally:
        p.shutdown()


@pytest.mark.parametrize("groups", [1, 2, 3, 7])
def test_layerwise_pack_gives_pack_checksummeds_bytes_and_checksum(groups: int) -> None:
    p = worker(produce=True, consume=False, seed=5)
    try:
        assert p.layout is not None
        ids = [9, 3, 4, 5, 17]
        whole = torch.zeros(p.layout.chunk_nbytes(len(ids)), dtype=torch.uint8)
        parts = whole.clone()
        nbytes, checksum = pack_checksummed(p.kv_caches, p.layout, ids, whole)
        part = LayerwisePack(p.kv_caches, p.layout, ids, parts)
        for end in group_ends(LAYERS, groups)[:-1]:
            part.pack_layers(end)
        assert part.finish() == (nbytes, checksum)
        assert torch.equal(parts, whole)
    finally:
        p.shutdown()


def test_group_ends() -> None:
    assert group_ends(32, 8) == [4, 8, 12, 16, 20, 24, 28, 32]
    assert group_ends(3, 8) == [1, 2, 3]
    assert group_ends(10, 3) == [4, 7, 10]
    assert layered_module.LayeredPacks is not None


def many_layer_worker(num_layers: int, **extra: object) -> FabricWorker:
    config = ConnectorConfig.from_extra(
        {"transport": "loopback", "chunk_tokens": CT, "store_mib": 8, **extra}
    )
    w = FabricWorker(config, produce=True, consume=False, block_size=BS, model="tiny")
    g = torch.Generator().manual_seed(3)
    w.register_kv_caches(
        {
            f"layer.{i}": torch.randn(BLOCKS, 2, BS, 16, generator=g).to(torch.bfloat16)
            for i in range(num_layers)
        }
    )
    return w


def test_hooks_in_any_order_never_pack_a_layer_before_its_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """12 layers, 4 groups, hooks shuffled, the pack thread joined after every
    hook (so an early read would be seen): every pack covers only layers
    already hooked, and the packed chunks equal a pack of the final KV."""
    p = many_layer_worker(12, layer_groups=4)
    try:
        hooked: set[int] = set()
        real = LayerwisePack.pack_layers

        def checked(self: LayerwisePack, upto: int) -> None:
            assert set(range(upto)) <= hooked, (upto, sorted(hooked))
            real(self, upto)

        monkeypatch.setattr(LayerwisePack, "pack_layers", checked)
        meta = step_meta("tcp://127.0.0.1:1")
        meta.sends.clear()  # NOTE: kept for reuse only: no decoder needed
        p._keys["p-req"] = []  # NOTE: set by the begin below
        p._begin(SendPlan("p-req", None, None, tokens(NUM_TOKENS), [4, 4, 2]))
        names = list(p._named_caches)
        new = final_kv(p)
        order = list(range(12))
        random.Random(7).shuffle(order)
        p.before_step()
        for i in order:
            p.kv_caches[i][SRC] = new[i]
            hooked.add(i)
            p.pack_layer(names[i], meta)
            p.flush()
        p.pack_step(meta)
        p.flush()
        assert p.counters.take()["chunks_packed_layerwise"] == 3
        assert p.layout is not None
        for chunk, key in zip(meta.packs, p_keys(p), strict=True):
            [slot] = p.store.acquire([key])
            want = torch.zeros(p.layout.chunk_nbytes(len(chunk.block_ids)), dtype=torch.uint8)
            pack_checksummed(p.kv_caches, p.layout, chunk.block_ids, want)
            got = p.store.pool.slot_view(slot)[: want.numel()]
            assert torch.equal(got, want), chunk.index
            p.store.release_slots([slot])
        assert_no_slot_held(p)
    finally:
        p.shutdown()


def p_keys(p: FabricWorker) -> list[bytes]:
    assert p.layout is not None
    return chunk_keys(tokens(NUM_TOKENS), CT, p.layout.fingerprint())


def test_a_forward_that_raised_keeps_and_pushes_nothing(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """The forward got to layer 0 and raised; vLLM still calls wait_for_save
    (from a finally): nothing of the step is committed or pushed, and the
    decoder's load fails (it recomputes) instead of loading stale layers."""
    p, d, meta = begin_step(pair)
    new = final_kv(p)
    p.kv_caches[0][SRC] = new[0]
    p.pack_layer(next(iter(p._named_caches)), meta)
    p.abandon(meta, "the step's forward raised RuntimeError")
    p.flush()
    assert p.store.stats().filled == 0
    assert_no_slot_held(p)
    plan = LoadPlan("d-req", "t1", 0, DST, NUM_TOKENS, tokens(NUM_TOKENS))
    d.start_load(FabricMetadata(loads=[plan]))
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    assert d.counters.take().get("chunks_loaded", 0) == 0


def test_wait_for_save_while_the_forward_raises_abandons_the_step() -> None:
    """vLLM's mixin calls wait_for_save in a finally around the forward."""
    calls: list[tuple[str, object]] = []
    worker_double = SimpleNamespace(
        pack_step=lambda meta: calls.append(("pack_step", meta)),
        abandon=lambda meta, why: calls.append(("abandon", why)),
    )
    connector = FabricConnector.__new__(FabricConnector)
    connector._worker = worker_double  # type: ignore[assignment]
    meta = FabricMetadata()
    connector.has_connector_metadata = lambda: True  # type: ignore[method-assign]
    connector._fabric_meta = lambda: meta  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("forward")
        finally:
            connector.wait_for_save()
    connector.wait_for_save()
    assert calls == [("abandon", "the step's forward raised RuntimeError"), ("pack_step", meta)]


def test_a_hook_that_fails_never_raises_into_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without async_save the groups are packed on the forward thread: a
    failure there is counted and the chunks are packed at the step's end."""
    p = worker(produce=True, consume=False, seed=1, layer_groups=3, async_save=False)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=5)
    try:
        assert d.node is not None

        def broken(*_: object) -> None:
            raise RuntimeError("injected")

        monkeypatch.setattr(layered_module.LayeredPacks, "prepare", broken)
        meta = step_meta(d.node.endpoint)
        begins: list[str] = []
        assert p.sender is not None
        real_begin = p.sender.begin
        monkeypatch.setattr(
            p.sender, "begin", lambda job: (begins.append(job.req_id), real_begin(job))[1]
        )
        p.before_step()
        forward(p, meta)  # NOTE: does not raise
        p.pack_step(meta)
        load(d)
        assert_same_kv(p, d)
        assert begins == ["p-req"]  # NOTE: begun once, by the first group
        counts = p.counters.take()
        assert counts["thread_errors"] >= 1 and "chunks_packed_layerwise" not in counts
        assert_no_slot_held(p)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_push_is_begun_once_when_its_groups_are_packed_early(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d = pair
    assert d.node is not None and p.sender is not None
    begins: list[str] = []
    real_begin = p.sender.begin
    monkeypatch.setattr(
        p.sender, "begin", lambda job: (begins.append(job.req_id), real_begin(job))[1]
    )
    meta = step_meta(d.node.endpoint)
    p.before_step()
    forward(p, meta)
    p.pack_step(meta)
    p.flush()
    load(d)
    assert begins == ["p-req"]
