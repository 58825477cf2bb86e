"""Per-request tables of a P/D worker pair go back to 0 however requests end.

A producing and a consuming worker (no vLLM engine, loopback data plane)
serve a mix of requests that end every way a request can: loaded,
fallen back (its transfer never came), failed at unpack, aborted before
its transfer came (whose push then comes late and is refused), given up
then pushed late (refused too), pushed but never loaded, aborted
mid-prefill on P, aborted on D with half its chunks in. vLLM's part is
played by hand: ``get_results`` once per "step" with the ids vLLM would
name in ``finished_req_ids``. Afterwards every table (read over the
control channel in the decoder's Stats, and from each worker's gauges) is
empty and no slot is reserved or held.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from fabric.errors import ChecksumMismatch
from fabric.integrations.vllm import loader as loader_module
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, PackChunk, SendPlan
from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.integrations.vllm.worker import FabricWorker
from fabric.transfer import server as server_module
from fabric.transfer.store_client import StoreClient
from tests.integrations.test_vllm_worker import CT, leased_pair, worker

LEASE_MS = 1000
SRC = [7, 8, 9, 10, 30, 31, 1, 2, 3, 4]
# NOTE: tables of peers and links are bounded by peers, not by requests:
# P stays D's peer (and keeps its link to D) after every request ended.
PEER_TABLES = ("_peers", "_links")
_prompts: dict[str, int] = {}


def prompt(tid: str, num_tokens: int) -> list[int]:
    """The token ids of transfer ``tid``: its own, so no two share a chunk."""
    base = _prompts.setdefault(tid, 1000 * (len(_prompts) + 1))
    return list(range(base, base + num_tokens))


@pytest.fixture
def pair() -> Iterator[tuple[FabricWorker, FabricWorker]]:
    p, d = leased_pair(LEASE_MS, load_timeout_s=3, unknown_transfer_grace_s=0.3)
    yield p, d
    p.shutdown()
    d.shutdown()


class Steps:
    """Drives both workers' ``get_results`` as vLLM's steps would, and
    collects what the decoder reports (each request must be reported once)."""

    def __init__(self, p: FabricWorker, d: FabricWorker) -> None:
        self.p, self.d = p, d
        self.finished: list[str] = []
        self.failed: list[str] = []

    def step(self, p_done: set[str] | None = None, d_done: set[str] | None = None) -> None:
        self.p.get_results(p_done or set())
        finished, failed = self.d.get_results(d_done or set())
        self.finished += finished
        self.failed += failed

    def until_reported(self, req_id: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while req_id not in self.finished:
            assert time.monotonic() < deadline, f"{req_id} was never reported"
            self.step()
            time.sleep(0.01)


def send(
    p: FabricWorker, d: FabricWorker, req: str, tid: str, num_tokens: int, chunks: int
) -> None:
    """P's step: announce ``tid`` to D and pack (push) its first ``chunks`` chunks."""
    assert d.node is not None
    counts = chunk_block_counts(num_tokens, CT, 16)
    packs, start = [], 0
    for index, n in enumerate(counts[:chunks]):
        packs.append(PackChunk(req, index, SRC[start : start + n]))
        start += n
    plan = SendPlan(req, tid, d.node.endpoint, prompt(tid, num_tokens), counts)
    p.pack_step(FabricMetadata(sends=[plan], packs=packs))
    p.before_step()


def load(d: FabricWorker, req: str, tid: str, num_tokens: int) -> None:
    plan = LoadPlan(req, tid, 0, list(range(20, 30)), num_tokens, prompt(tid, num_tokens))
    d.start_load(FabricMetadata(loads=[plan]))


def wait_filled(d: FabricWorker, tid: str, index: int) -> None:
    assert d.node is not None and d.node.server is not None
    prog = d.node.server.wait_until(tid, lambda p: index in p.filled, 10)
    assert prog is not None and index in prog.filled


def run_mixed(p: FabricWorker, d: FabricWorker, monkeypatch: pytest.MonkeyPatch) -> Steps:
    """Every way a request ends; returns the steps driver (all reported)."""
    steps = Steps(p, d)
    # loaded
    send(p, d, "p-ok", "t-ok", 150, 3)
    load(d, "d-ok", "t-ok", 150)
    steps.until_reported("d-ok")
    # fallen back: its transfer never comes
    load(d, "d-none", "t-none", 150)
    steps.until_reported("d-none")
    # failed at unpack
    with monkeypatch.context() as m:

        def corrupt(*args: object, **kwargs: object) -> None:
            raise ChecksumMismatch("injected at use")

        m.setattr(loader_module, "unpack", corrupt)
        send(p, d, "p-bad", "t-bad", 64, 1)
        load(d, "d-bad", "t-bad", 64)
        steps.until_reported("d-bad")
    # aborted on D before its transfer came; its push then comes late (refused)
    load(d, "d-ab", "t-ab", 150)
    steps.step(d_done={"d-ab"})
    steps.until_reported("d-ab")
    send(p, d, "p-ab", "t-ab", 150, 3)
    # given up (grace), then pushed late (refused)
    load(d, "d-late", "t-late", 64)
    steps.until_reported("d-late")
    send(p, d, "p-late", "t-late", 64, 1)
    # pushed, never loaded
    send(p, d, "p-never", "t-never", 64, 1)
    # aborted on P mid-prefill (one chunk of three computed)
    send(p, d, "p-mid", "t-mid", 150, 1)
    # aborted on D with one chunk of three in
    send(p, d, "p-part", "t-part", 150, 1)
    load(d, "d-part", "t-part", 150)
    wait_filled(d, "t-part", 0)
    steps.step(d_done={"d-part"})
    steps.until_reported("d-part")
    # vLLM names every P request once it ended (all with max_tokens=1)
    steps.step(p_done={"p-ok", "p-bad", "p-ab", "p-late", "p-never", "p-mid", "p-part"})
    return steps


def per_request(tables: dict[str, int]) -> dict[str, int]:
    """The non-empty tables among ``tables`` that are kept per request; the
    ones kept per peer must hold at most the one peer of this test."""
    assert all(n <= 1 for name, n in tables.items() if name.endswith(PEER_TABLES)), tables
    return {name: n for name, n in tables.items() if n and not name.endswith(PEER_TABLES)}


def d_tables(client: StoreClient) -> dict[str, int]:
    stats = client.stats()
    return {k.removeprefix("tables."): v for k, v in stats.items() if k.startswith("tables.")}


def settle(steps: Steps, client: StoreClient, timeout: float = 20) -> dict[str, int]:
    """Step until the decoder tracks no transfer and its Stats show every
    per-request table empty."""
    server = steps.d.node.server if steps.d.node is not None else None
    assert server is not None
    deadline = time.monotonic() + timeout
    while True:
        steps.step()
        tracked = [tid for tid in _prompts if server.progress(tid) is not None]
        tables = d_tables(client)
        if not tracked and "server_progress" in tables and not per_request(tables):
            return tables
        assert time.monotonic() < deadline, f"still tracked: {tracked}, tables: {tables}"
        time.sleep(0.05)


def test_every_table_empties_however_requests_end(
    pair: tuple[FabricWorker, FabricWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d = pair
    assert d.node is not None
    steps = run_mixed(p, d, monkeypatch)
    server = d.node.server
    assert server is not None
    # NOTE: the two pushes that came after their loads ended are refused
    deadline = time.monotonic() + 20
    while server.snapshot()["server_reserves_late"] < 2:  # t-ab, t-late
        assert time.monotonic() < deadline, server.snapshot()
        steps.step()
        time.sleep(0.05)
    # NOTE: transfers released before they came are forgotten ABANDONED_LINGER_S (40 s) later: now
    monkeypatch.setattr(server_module, "ABANDONED_LINGER_S", 0.0)
    client = StoreClient(d.node.endpoint, timeout_ms=3000)
    try:
        tables = settle(steps, client)
    finally:
        client.close()
    # each decoder request reported once, and only "d-ok" loaded
    expected = {"d-ok", "d-none", "d-bad", "d-ab", "d-late", "d-part"}
    assert sorted(steps.finished) == sorted(expected)
    assert set(steps.failed) == expected - {"d-ok"}
    # the Stats reply names the tables of every component
    for name in ("server_progress", "store_leases", "loader_active", "worker_keys"):
        assert name in tables, name
    assert tables["server_peers"] == 1
    # the gauges the workers set each step say the same
    steps.step()
    p.flush()
    steps.step()
    for w in (p, d):
        gauges = w.counters.tables()
        assert gauges and not per_request(gauges), gauges
        assert (
            w.store.stats().reserved == 0 and w.store.table_sizes()["store_referenced_slots"] == 0
        )
    counts = d.counters.take()
    assert counts["loads_ok"] == 1 and counts["loads_ended"] == 2


def test_a_load_whose_request_ended_is_released_and_reported_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM keeps an aborted request's blocks until its load is reported: the
    decoder reports it the step after vLLM names it, not after its timeouts."""
    p = worker(produce=True, consume=False, seed=1)
    d = worker(
        produce=False, consume=True, seed=2, load_timeout_s=600, unknown_transfer_grace_s=600
    )
    try:
        steps = Steps(p, d)
        send(p, d, "p1", "t1", 150, 1)
        load(d, "d1", "t1", 150)
        wait_filled(d, "t1", 0)
        steps.step(d_done={"d1"})
        steps.until_reported("d1")  # NOTE: a hang guard far below the 600 s timeouts
        assert steps.failed == ["d1"]
        assert d.store.reservation("t1") is None  # released: its slots go back
        assert d.loader is not None and d.loader.table_sizes()["loader_active"] == 0
    finally:
        p.shutdown()
        d.shutdown()
