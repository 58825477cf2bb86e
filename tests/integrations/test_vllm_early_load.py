"""A decoder admitted at dispatch: its load waits on the proxy's word.

A producing and a consuming worker over the loopback data plane (as in
``test_vllm_worker.py``); the proxy's ``PrefillState`` words go over the
decoder's real control port with a :class:`StoreClient`. The bounds are
small (unknown transfer 0.3 s, load 1 s) so that a load which outlives
them can only be waiting on the word.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from fabric.errors import TransferError
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, PackChunk, SendPlan
from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.integrations.vllm.worker import FabricWorker
from fabric.transfer import server as server_module
from fabric.transfer.store_client import StoreClient

from .test_vllm_worker import tokens, wait_results, worker

SRC = [7, 8, 9, 10, 30, 31, 1, 2, 3, 4]  # P's blocks of a 150-token prompt (4, 4, 2)
DST = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]


@pytest.fixture
def pair() -> Iterator[tuple[FabricWorker, FabricWorker]]:
    p = worker(produce=True, consume=False, seed=1)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=1, unknown_transfer_grace_s=0.3)
    yield p, d
    p.shutdown()
    d.shutdown()


@pytest.fixture
def word(pair: tuple[FabricWorker, FabricWorker]) -> Iterator[StoreClient]:
    """The proxy's line to the decoder's control port."""
    _, d = pair
    assert d.node is not None
    with StoreClient(d.node.endpoint, timeout_ms=5000) as client:
        yield client


class Beat:
    """Say ``running`` for ``tid`` every 0.1 s, each word good for 1 s, until
    stopped: a wait longer than 1 s holds only if the words are refreshed."""

    def __init__(self, client: StoreClient, tid: str) -> None:
        self.client, self.tid = client, tid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Beat:
        self.client.prefill_state([self.tid], "running", ttl_ms=1000)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.client.prefill_state([self.tid], "running", ttl_ms=1000)


def push(p: FabricWorker, endpoint: str, tid: str) -> None:
    """P computes and pushes the 150-token prompt as transfer ``tid``."""
    counts = chunk_block_counts(150, 64, 16)
    packs, start = [], 0
    for index, n in enumerate(counts):
        packs.append(PackChunk("p-req", index, SRC[start : start + n]))
        start += n
    p.pack_step(
        FabricMetadata(sends=[SendPlan("p-req", tid, endpoint, tokens(150), counts)], packs=packs)
    )


def load(d: FabricWorker, tid: str) -> None:
    d.start_load(FabricMetadata(loads=[LoadPlan("d-req", tid, 0, DST, 150, tokens(150))]))


def results_now(d: FabricWorker) -> tuple[set[str], set[str]]:
    return d.get_results(set())


def test_a_load_waits_past_its_bounds_while_the_prefill_is_said_running(
    pair: tuple[FabricWorker, FabricWorker], word: StoreClient
) -> None:
    """Old code: the load fails after the 0.3 s grace ("no transfer reached")."""
    p, d = pair
    assert d.node is not None
    with Beat(word, "t-early"):
        load(d, "t-early")  # NOTE: before P pushed anything, as at dispatch
        time.sleep(1.5)  # past the unknown grace and the load timeout
        assert results_now(d) == (set(), set())
        push(p, d.node.endpoint, "t-early")
        assert wait_results(d) == ({"d-req"}, set())
    word.prefill_state(["t-early"], "done", ttl_ms=1)
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for b, (s, t) in enumerate(zip(SRC, DST, strict=True)):
            assert torch.equal(d_layer[t], p_layer[s]), b
    assert d.counters.take()["loads_ok"] == 1


@pytest.fixture
def patient() -> Iterator[tuple[FabricWorker, StoreClient]]:
    """A decoder whose own bounds (60 s) are far beyond any wait of a test:
    only the word can end its loads; and the proxy's line to it."""
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=60, unknown_transfer_grace_s=60)
    assert d.node is not None
    try:
        with StoreClient(d.node.endpoint, timeout_ms=5000) as client:
            yield d, client
    finally:
        d.shutdown()


def test_a_failed_prefill_fails_the_load_at_once_with_its_reason(
    patient: tuple[FabricWorker, StoreClient], caplog: pytest.LogCaptureFixture
) -> None:
    d, client = patient
    client.prefill_state(["t-dead"], "running", ttl_ms=60_000)
    load(d, "t-dead")
    caplog.set_level(logging.WARNING)
    client.prefill_state(["t-dead"], "failed", ttl_ms=1, reason="P died")
    assert wait_results(d, timeout=10) == ({"d-req"}, {"d-req"})
    assert "the prefill of t-dead failed: P died" in caplog.text
    assert d.counters.take()["load_failures"] == 1


def test_a_word_that_runs_out_fails_the_load(
    patient: tuple[FabricWorker, StoreClient], caplog: pytest.LogCaptureFixture
) -> None:
    d, client = patient
    client.prefill_state(["t-gone"], "running", ttl_ms=300)
    load(d, "t-gone")
    caplog.set_level(logging.WARNING)
    assert wait_results(d, timeout=10) == ({"d-req"}, {"d-req"})
    assert "no word of the prefill of t-gone" in caplog.text


def test_after_done_the_missing_chunks_are_bounded_from_the_prefills_end(
    word: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The 2 s load bound counts from ``done``: a load that already waited
    2.5 s is still waiting 0.3 s after it (counted from its start, it would
    fail at once), and fails about 2 s after it."""
    p = worker(produce=True, consume=False, seed=1)
    d = worker(produce=False, consume=True, seed=2, load_timeout_s=2, unknown_transfer_grace_s=0.3)
    try:
        assert d.node is not None
        counts = chunk_block_counts(150, 64, 16)
        with StoreClient(d.node.endpoint, timeout_ms=5000) as client:
            with Beat(client, "t-short"):
                load(d, "t-short")
                # NOTE: P reserves but never computes its chunks
                sends = [SendPlan("p-req", "t-short", d.node.endpoint, tokens(150), counts)]
                p.pack_step(FabricMetadata(sends=sends))
                time.sleep(2.5)  # past load_timeout_s from the load's start
                assert results_now(d) == (set(), set())
            caplog.set_level(logging.WARNING)
            client.prefill_state(["t-short"], "done", ttl_ms=1)
            time.sleep(0.3)
            assert results_now(d) == (set(), set())
            assert wait_results(d, timeout=10) == ({"d-req"}, {"d-req"})
        assert "not in after" in caplog.text
        assert d.store.reserved_count() == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_a_failed_word_after_every_chunk_landed_keeps_the_load(
    pair: tuple[FabricWorker, FabricWorker], word: StoreClient
) -> None:
    """P pushed everything, then its answer failed (a timeout): what came is
    complete and verified, so it is used."""
    p, d = pair
    assert d.node is not None and d.node.server is not None
    server = d.node.server
    word.prefill_state(["t-all"], "running", ttl_ms=60_000)
    push(p, d.node.endpoint, "t-all")
    deadline = time.monotonic() + 10
    while (prog := server.progress("t-all")) is None or not prog.complete:
        assert time.monotonic() < deadline, "the push never completed"
        time.sleep(0.01)
    word.prefill_state(["t-all"], "failed", ttl_ms=1, reason="P timed out")
    load(d, "t-all")
    assert wait_results(d) == ({"d-req"}, set())
    for p_layer, d_layer in zip(p.kv_caches, d.kv_caches, strict=True):
        for s, t in zip(SRC, DST, strict=True):
            assert torch.equal(d_layer[t], p_layer[s])


def test_a_push_that_comes_after_its_load_gave_up_takes_no_slot(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequential flow, P late (a backlog): D's load stops waiting after its
    grace, then P's Reserve comes. It is refused; the old code reserved it,
    and its chunks, which nobody loads, held slots of D's store for the whole
    lease (in the full run, enough of them filled D's store: every later push
    was refused and no KV arrived at all)."""
    p, d = pair
    assert d.node is not None and d.node.server is not None
    server = d.node.server
    load(d, "t-late")  # NOTE: no word: the sequential flow's bounds
    assert wait_results(d) == ({"d-req"}, {"d-req"})
    push(p, d.node.endpoint, "t-late")
    moved: dict[str, int] = {}
    deadline = time.monotonic() + 10
    while not (moved.get("push_failures") or moved.get("chunks_sent")):
        assert time.monotonic() < deadline, f"the push never ended: {moved}"
        for name, n in p.counters.take().items():
            if isinstance(n, int):  # NOTE: histograms come as lists
                moved[name] = moved.get(name, 0) + n
        time.sleep(0.01)
    assert moved.get("push_failures") == 1 and not moved.get("chunks_sent"), moved
    snap = server.snapshot()
    assert snap["server_reserves_late"] == 1
    sizes = server.table_sizes()
    assert (sizes["store_leases"], sizes["store_referenced_slots"]) == (0, 0), sizes
    assert snap["reserved"] == 0, snap
    # NOTE: P lets go of its chunks too; and D forgets the transfer in time
    assert p.store.stats().reserved == 0
    assert p.store.table_sizes()["store_referenced_slots"] == 0
    assert sizes["server_abandoned"] == 1
    monkeypatch.setattr(server_module, "ABANDONED_LINGER_S", 0.0)
    while server.table_sizes()["server_abandoned"]:
        assert time.monotonic() < deadline + 10, "the released transfer is never forgotten"
        time.sleep(0.05)


def test_the_server_refuses_an_unknown_state_and_prunes_its_notes(
    pair: tuple[FabricWorker, FabricWorker], word: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, d = pair
    assert d.node is not None and d.node.server is not None
    server = d.node.server
    with pytest.raises(TransferError, match="not one of"):
        word.prefill_state(["t1"], "maybe", ttl_ms=1000)
    assert word.prefill_state(["t1", "t2"], "running", ttl_ms=1000) == 2
    assert server.table_sizes()["server_prefills"] == 2
    assert server.snapshot()["server_prefill_notes"] == 2
    # NOTE: final: a late "running" (reordered) does not bring a failed one back
    assert word.prefill_state(["t3"], "failed", ttl_ms=1, reason="gone") == 1
    assert word.prefill_state(["t3"], "running", ttl_ms=1000) == 0
    note = server.prefill_note("t3")
    assert note is not None and (note.state, note.reason) == ("failed", "gone")
    # NOTE: the loader's release, once its load ended: later words are ignored a while
    server.release("t4")
    assert word.prefill_state(["t4"], "done", ttl_ms=1) == 0
    assert server.snapshot()["server_prefill_notes_late"] == 2  # t3's running, t4's done
    assert server.table_sizes()["server_prefills"] == 4
    monkeypatch.setattr(server_module, "PREFILL_NOTE_LINGER_S", 0.0)
    monkeypatch.setattr(server_module, "RELEASED_LINGER_S", 0.0)
    word.prefill_state(["t1"], "done", ttl_ms=1)
    deadline = time.monotonic() + 10
    # NOTE: final and released ones go at the next prune; the running one once its word ran out
    while server.table_sizes()["server_prefills"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.table_sizes()["server_prefills"] == 0


def test_an_idle_step_waits_for_a_load_instead_of_spinning(
    pair: tuple[FabricWorker, FabricWorker], word: StoreClient
) -> None:
    """vLLM steps again 1 ms after a step without tokens while a request waits
    for remote KV; such a step waits here (at most 20 ms) until a load ends.
    Old code: thousands of empty steps a second."""
    p, d = pair
    assert d.node is not None
    with Beat(word, "t-idle"):
        load(d, "t-idle")
        calls, started = 0, time.monotonic()
        while time.monotonic() - started < 1.0:
            assert d.get_results(set(), idle=True) == (set(), set())
            calls += 1
        assert calls <= 80, calls  # about 50 of 20 ms
        push(p, d.node.endpoint, "t-idle")
        deadline = time.monotonic() + 10
        while not (results := d.get_results(set(), idle=True))[0]:
            assert time.monotonic() < deadline, "the load never ended"
        assert results == ({"d-req"}, set())
