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
import itertools
import random
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from fabric.errors import TransferError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.connector import FabricConnector
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, PackChunk, SendPlan
from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.integrations.vllm.worker import FabricWorker
from fabric.kv import chunk_keys, pack_checksummed
from fabric.kv.layerwise import LayerwisePack, group_ends
from fabric.transfer import protocol as proto
from fabric.transfer.nixl_plane import nixl_available
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
    """Groups shrink toward the end, each at most twice the next, the last as
    small as that allows (what is left after the forward)."""
    assert group_ends(32, 8) == [5, 10, 15, 20, 25, 29, 31, 32]
    assert group_ends(32, 2) == [21, 32] and group_ends(32, 1) == [32]
    assert group_ends(10, 3) == [4, 8, 10]
    assert group_ends(3, 8) == [1, 2, 3] and group_ends(1, 8) == [1]
    assert group_ends(4, 4) == [1, 2, 3, 4]
    for layers in range(1, 130):
        for groups in range(1, 40):
            ends = group_ends(layers, groups)
            sizes = [b - a for a, b in itertools.pairwise([0, *ends])]
            assert len(ends) == min(groups, layers) and ends[-1] == layers
            assert min(sizes) >= 1
            assert all(a >= b for a, b in itertools.pairwise(sizes))  # shrinking
            assert all(a <= 2 * b for a, b in itertools.pairwise(sizes))  # covered by the next
            if groups < layers:  # NOTE: x, 2x, 4x ... hold x * (2**groups - 1) layers
                assert sizes[-1] == -(-layers // (2**groups - 1))


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


# ------------------------------------------------------------ layer writes


def streams(d: FabricWorker) -> dict[int, int]:
    """Chunk -> layers D's loader unpacked so far of the load ``d-req``."""
    assert d.loader is not None
    active = d.loader._active.get("d-req")
    return {} if active is None else {i: s.layers_done for i, (_, s) in active.streams.items()}


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.005)


@pytest.fixture(params=["loopback", "tcp", "nixl"])
def wired_pair(request: pytest.FixtureRequest) -> Iterator[tuple[FabricWorker, FabricWorker]]:
    """The pair over each data plane (TCP admits one write into a slot at a
    time; NIXL does not see writes land)."""
    if request.param == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed")
    wire = {"transport": request.param}
    p = worker(produce=True, consume=False, seed=1, layer_groups=LAYERS, **wire)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=5, **wire)
    yield p, d
    p.shutdown()
    d.shutdown()


def test_groups_packed_during_the_forward_land_and_are_unpacked_before_the_step_ends(
    wired_pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """D admitted at dispatch: its load waits while P computes. Every group
    P packs during the forward is written at once and D unpacks it as it
    lands (hashed in the same pass); after the step only the last layer is
    left, and D's chunks are indexed with the digest it took."""
    p, d, meta = begin_step(wired_pair)
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST, NUM_TOKENS, tokens(150))]))
    names = list(p._named_caches)
    forward(p, meta, names[:-1])  # NOTE: the forward up to its last layer
    p.flush()
    wait_for(lambda: streams(d) == {0: LAYERS - 1, 1: LAYERS - 1, 2: LAYERS - 1}, "streamed")
    forward(p, meta, names[-1:])
    p.pack_step(meta)
    p.flush()
    assert wait_results(d) == ({"d-req"}, set())
    assert_same_kv(p, d)
    counts = d.counters.take()
    assert counts["chunks_streamed"] == 3 and "streams_redone" not in counts
    sent = p.counters.take()
    assert sent["parts_sent"] >= 3
    # NOTE: the parts' bytes count as sent: the chunks' bytes in all, once
    assert p.layout is not None
    assert sent["bytes_sent"] == sum(p.layout.chunk_nbytes(n) for n in (4, 4, 2))
    assert d.node is not None and d.node.server is not None
    assert d.node.server.stats.parts_landed >= 3
    assert d.store.reserved_count() == 0 and d.loader is not None
    assert d.loader.table_sizes()["loader_active"] == 0
    # NOTE: indexed as verified: a later load of the same prompt reuses D's chunks
    assert d.layout is not None
    keys = chunk_keys(tokens(150), CT, d.layout.fingerprint())
    assert d.store.lookup(keys) == len(keys) == 3
    assert_no_slot_held(p)


def test_without_layer_writes_a_chunk_is_written_once_packed_whole() -> None:
    p = worker(produce=True, consume=False, seed=1, layer_groups=LAYERS, layer_writes=False)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=5)
    try:
        p, d, meta = begin_step((p, d))
        d.start_load(
            FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST, NUM_TOKENS, tokens(150))])
        )
        forward(p, meta)
        p.pack_step(meta)
        p.flush()
        assert wait_results(d) == ({"d-req"}, set())
        assert_same_kv(p, d)
        assert "parts_sent" not in p.counters.take()
        assert "chunks_streamed" not in d.counters.take()
    finally:
        p.shutdown()
        d.shutdown()


def packed_chunk(p: FabricWorker) -> tuple[bytes, int, int, int]:
    """The 64-token prompt's chunk packed and committed in P's store:
    (key, slot, nbytes, checksum)."""
    assert p.layout is not None
    key = chunk_keys(tokens(64), CT, p.layout.fingerprint())[0]
    slot = p.store.allocate(key)
    view = p.store.pool.slot_view(slot)
    nbytes, checksum = pack_checksummed(p.kv_caches, p.layout, SRC[:4], view)
    p.store.commit(slot, key, nbytes, checksum)
    return key, slot, nbytes, checksum


def part_then_whole(
    p: FabricWorker, d: FabricWorker, garbage: bool, *, flip_whole: bool = False
) -> tuple[int, int]:
    """P's link writes chunk 0's first layers from a slot of garbage (or of
    the chunk), then the whole chunk with its checksum (``flip_whole``: with
    a byte of layer 0 flipped, the checksum the good one); (slot, nbytes)
    of the chunk on P."""
    assert d.node is not None and p.node is not None and p.node.client is not None
    assert p.layout is not None
    key, slot, nbytes, checksum = packed_chunk(p)
    junk = p.store.allocate(b"junk" * 4)
    view = p.store.pool.slot_view(junk)
    view[:nbytes] = p.store.pool.slot_view(slot)[:nbytes]
    if garbage:
        view[:8] ^= 0xFF  # NOTE: layer 0's first bytes
    link = p.node.client.connect(d.node.endpoint)
    res = link.reserve("t1", [key], [nbytes])
    per_layer = nbytes // LAYERS
    wait_for(lambda: "d-req" in (d.loader._active if d.loader else {}), "the load began")
    link.write_part(res, 0, junk, (0, per_layer), 1).wait(5)
    wait_for(lambda: streams(d) == {0: 1}, "layer 0 unpacked")
    whole = slot
    if flip_whole:
        whole = p.store.allocate(b"flip" * 4)
        bad = p.store.pool.slot_view(whole)
        bad[:nbytes] = p.store.pool.slot_view(slot)[:nbytes]
        bad[5] ^= 0x01
        p.store.commit(whole, b"flip" * 4, nbytes, checksum)  # NOTE: the chunk's checksum
    link.write(res, [0], [whole]).wait(5)  # NOTE: whole: from another slot than the part's
    p.store.abort(junk)
    return slot, nbytes


@pytest.mark.parametrize("garbage", [False, True], ids=["same-bytes", "garbage-part"])
def test_a_part_that_is_not_the_chunks_is_caught_and_the_chunk_unpacked_again(
    pair: tuple[FabricWorker, FabricWorker], garbage: bool
) -> None:
    """A part's bytes that the whole write then replaced (a chunk packed
    whole after its layer-wise pack failed): D's streamed digest does not
    match, so the slot is verified whole and the chunk unpacked again; the
    blocks hold the chunk's KV, never the part's."""
    p, d = pair
    dst = DST[:4]
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, dst, 64, tokens(64))]))
    part_then_whole(p, d, garbage)
    assert wait_results(d) == ({"d-req"}, set())
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for s, t in zip(SRC[:4], dst, strict=True):
            assert torch.equal(d_layer[t], p_layer[s])
    counts = d.counters.take()
    # NOTE: the same bytes too: the whole write rewrote what D had read
    assert counts["streams_redone"] == 1 and counts["chunks_loaded"] == 1
    assert "chunks_streamed" not in counts


def test_streamed_bytes_corrupted_in_the_decoders_slot_fail_the_load(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """A chunk whose bytes in D's slot do not hash to P's checksum (flipped
    after they landed, before D read them) is never loaded: the streamed
    digest fails, the slot fails too, vLLM is told to recompute."""
    p, d, meta = begin_step(pair)
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST, NUM_TOKENS, tokens(150))]))
    assert d.loader is not None
    real_stream = d.loader._stream
    flipped: list[int] = []

    def corrupt_then_stream(load: object, prog: object, res: object) -> bool:
        parts = getattr(prog, "parts", {})
        if parts.get(1) and not flipped:
            slot = res.slots[1]  # type: ignore[attr-defined]
            d.store.pool.slot_view(slot)[3] ^= 0x01
            flipped.append(slot)
        return real_stream(load, prog, res)  # type: ignore[arg-type]

    d.loader._stream = corrupt_then_stream  # type: ignore[method-assign]
    names = list(p._named_caches)
    forward(p, meta, names[:-1])
    p.flush()
    # NOTE: chunk 1's first layers landed and were read
    wait_for(lambda: bool(flipped) and streams(d).get(1) == LAYERS - 1, "streamed")
    forward(p, meta, names[-1:])
    p.flush()
    p.pack_step(meta)
    p.flush()
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    counts = d.counters.take()
    assert flipped and counts["streams_redone"] == 1 and counts["corrupt_chunks"] == 1
    assert counts["load_failures"] == 1
    assert d.store.reserved_count() == 0


def test_a_part_write_that_fails_fails_the_push_and_holds_no_slot(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link refuses the second part of a chunk (the receiver went away
    mid-forward): the push fails (D is told by a Cancel and recomputes),
    the chunk's slot handed over at the step's end is released, and P's
    store keeps the chunks for reuse with nothing reserved."""
    p, d, meta = begin_step(pair)
    assert p.node is not None and p.node.client is not None and d.node is not None
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST, NUM_TOKENS, tokens(150))]))
    link = p.node.client.connect(d.node.endpoint)
    real = link.write_part
    calls: list[int] = []

    def flaky(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise TransferError("the receiver went away")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(link, "write_part", flaky)
    forward(p, meta)
    p.pack_step(meta)
    p.flush()
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    assert len(calls) >= 2
    counts = p.counters.take()
    assert counts["push_failures"] == 1
    wait_for(lambda: p.store.table_sizes()["store_referenced_slots"] == 0, "released")
    assert_no_slot_held(p)


@pytest.mark.parametrize("reloaded", [False, True], ids=["same-route", "route-loaded-again"])
def test_the_landed_skip_holds_only_over_the_route_the_part_went_over(
    pair: tuple[FabricWorker, FabricWorker], reloaded: bool
) -> None:
    """A chunk's last write skips the bytes its parts wrote -- over the same
    route only: NIXL can report a write done whose bytes never landed on a
    route that died, and a route loaded again since has the chunk sent
    whole. The part's bytes are then lost here (flipped in D's slot): the
    skip fails the chunk, the whole write verifies."""
    p, d = pair
    assert d.node is not None and p.node is not None and p.node.client is not None
    assert p.layout is not None and d.node.server is not None
    key, slot, nbytes, _ = packed_chunk(p)
    link = p.node.client.connect(d.node.endpoint)
    res = link.reserve("t1", [key], [nbytes])
    part = link.write_part(res, 0, slot, (0, nbytes // LAYERS), 1)
    part.wait(5)
    reservation = d.store.reservation("t1")
    assert reservation is not None
    d.store.pool.slot_view(reservation.slots[0])[:8] ^= 0xFF  # NOTE: the part "never landed"
    if reloaded:
        link._reload_agent("test: the route died")
    landed = {0: nbytes // LAYERS}
    link.write(res, [0], [slot], landed=landed, landed_epoch=part.route_epoch).wait(5)
    server = d.node.server
    wait_for(lambda: (prog := server.progress("t1")) is not None and prog.finished, "verified")
    prog = server.progress("t1")
    assert prog is not None
    assert (prog.filled, prog.failed) == (({0}, set()) if reloaded else (set(), {0}))


def test_a_last_write_that_rewrites_streamed_bytes_is_verified_anew(
    pair: tuple[FabricWorker, FabricWorker],
) -> None:
    """D read layer 0 from a good part; the chunk's last write then came whole
    and flipped a byte of layer 0 (corrupt in transit; the checksum is the
    chunk's). D's digest of what it read matches, but the slot no longer
    holds it: the WriteDone says the write began at byte 0, so D verifies
    the slot whole, which fails, and the load fails (vLLM recomputes);
    nothing is indexed. (Before, the load passed with the good bytes read
    and the slot was indexed holding the flipped one.)"""
    p, d = pair
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", "t1", 0, DST[:4], 64, tokens(64))]))
    part_then_whole(p, d, garbage=False, flip_whole=True)
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    counts = d.counters.take()
    assert counts["streams_redone"] == 1 and counts["corrupt_chunks"] == 1
    assert d.layout is not None
    assert d.store.lookup(chunk_keys(tokens(64), CT, d.layout.fingerprint())) == 0


@pytest.mark.parametrize("reloaded", [False, True], ids=["same-route", "route-loaded-again"])
def test_a_last_writes_done_says_where_its_bytes_begin(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch, reloaded: bool
) -> None:
    """WriteDone.starts: the landed bytes the last write skipped; 0 when the
    route was loaded again while it was posted (it then went whole)."""
    p, d = pair
    assert d.node is not None and p.node is not None and p.node.client is not None
    assert p.layout is not None
    key, slot, nbytes, _ = packed_chunk(p)
    client = p.node.client
    link = client.connect(d.node.endpoint)
    res = link.reserve("t1", [key], [nbytes])
    per_layer = nbytes // LAYERS
    part = link.write_part(res, 0, slot, (0, per_layer), 1)
    part.wait(5)
    sent: list[tuple[list[tuple[int, int, int]], object]] = []
    real_post = client.plane.post_write

    def post_write(peer: str, segments: list[tuple[int, int, int]], notif: bytes, fence: object):  # type: ignore[no-untyped-def]
        sent.append((segments, client.codec.decode(notif, fresh=False)))
        return real_post(peer, segments, notif, fence)  # type: ignore[arg-type]

    monkeypatch.setattr(client.plane, "post_write", post_write)
    if reloaded:
        link._route_suspect = True  # NOTE: a control call failed: reloaded as the write posts
    link.write(res, [0], [slot], landed={0: per_layer}, landed_epoch=part.route_epoch).wait(5)
    ((segments, done),) = sent
    assert isinstance(done, proto.WriteDone) and done.indices == [0]
    want = 0 if reloaded else per_layer
    assert done.starts == [want] and segments[0][2] == nbytes - want
