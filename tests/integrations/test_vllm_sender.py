"""PushSender: every slot ref released exactly once; a slow or dead decoder
stalls only its own pushes; a dead one is backed off and holds nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import FabricCounters
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, SaveChunk, SendPlan
from fabric.integrations.vllm.scheduler import chunk_block_counts
from fabric.integrations.vllm.sender import (
    FIRST_BACKOFF_S,
    MAX_WAITING,
    PushJob,
    PushSender,
    _Peer,
)
from fabric.integrations.vllm.worker import FabricWorker
from fabric.launch.process import free_port
from fabric.store import ChunkStore, StoreConfig
from tests.transfer.silent import KINDS, silent_endpoint


class Landed:
    nbytes = 8

    def done(self) -> bool:
        return True

    def abort(self) -> bool:
        return False


class Raising(Landed):
    def done(self) -> bool:
        raise RuntimeError("check_xfer_state raised")


def test_a_write_that_raises_after_another_landed_releases_each_slot_once() -> None:
    store = ChunkStore(StoreConfig(slot_bytes=64, num_slots=4))
    k1, k2 = b"a" * 16, b"b" * 16
    for key in (k1, k2):
        store.commit(store.allocate(key), key, 8)
    s1, s2 = store.acquire([k1])[0], store.acquire([k2])[0]  # the sender's refs
    store.acquire([k1])  # another holder of k1 (a tier hold, the shared saver)
    counters = FabricCounters()
    sender = PushSender(None, store, counters, lease_ms=1000, push_timeout_s=5)  # type: ignore[arg-type]
    sender.close()  # NOTE: drive its progress by hand
    job = PushJob("r", "t", "tcp://x:1", [k1, k2], [8, 8], written=2)
    job.inflight = [(s1, Landed(), time.monotonic()), (s2, Raising(), time.monotonic())]  # type: ignore[list-item]
    peer = _Peer(job.endpoint, sender._serve, "test")  # NOTE: never started
    sender._jobs["r"], peer.jobs[id(job)], peer.admitted = job, job, 1
    sender._progress(peer)
    assert "r" not in sender._jobs and not peer.jobs and counters.take()["thread_errors"] == 1
    assert store.acquire([k1]) == [s1]  # the other holder's ref survived: k1 still held
    store.release_slots([s1, s1])
    assert store.stats().reserved == 0


# ---------------------------------------------------------------- real workers
# A prefilling and a decoding FabricWorker (no vLLM engine) over real ZMQ
# control sockets, next to receivers that never answer (tests/transfer/silent.py).

BS, CT, LAYERS, BLOCKS = 16, 64, 3, 40
GRACE_S = 1.0
PER_REQUEST_TABLES = ("sender_jobs", "sender_queued", "sender_leases")


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}": torch.randn(BLOCKS, 2, BS, 2 * 8, generator=g).to(torch.bfloat16)
        for i in range(LAYERS)
    }


def worker(*, produce: bool, seed: int, **extra: object) -> FabricWorker:
    config = ConnectorConfig.from_extra(
        {"transport": "loopback", "chunk_tokens": CT, "store_mib": 4, **extra}
    )
    w = FabricWorker(config, produce=produce, consume=not produce, block_size=BS, model="tiny")
    w.register_kv_caches(caches(seed))
    return w


@pytest.fixture(params=["loopback", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[FabricWorker, FabricWorker]]:
    p = worker(produce=True, seed=1, transport=request.param)
    d = worker(
        produce=False,
        seed=2,
        transport=request.param,
        load_timeout_s=10,
        unknown_transfer_grace_s=GRACE_S,
    )
    yield p, d
    p.shutdown()
    d.shutdown()


def prompt(n: int) -> list[int]:
    """Request ``n``'s one-chunk prompt (its own key)."""
    return [n * CT + t for t in range(CT)]


def push(p: FabricWorker, req: str, endpoint: str, tokens: list[int]) -> None:
    """What the connector does for a prefill of ``tokens`` pushed to ``endpoint``."""
    send = SendPlan(req, f"t-{req}", endpoint, tokens, chunk_block_counts(len(tokens), CT, BS))
    p.save(FabricMetadata(sends=[send], saves=[SaveChunk(req, 0, [3, 4, 5, 6])]))
    p.before_step()  # NOTE: joins the pack, as the next engine step does
    p.get_results({req})  # the prefill is done: vLLM reports it finished


def load(d: FabricWorker, req: str, tokens: list[int]) -> tuple[set[str], set[str]]:
    """Start the decoder's load of ``req`` and wait for its result."""
    plan = LoadPlan(req, f"t-{req}", 0, [10, 11, 12, 13], len(tokens), tokens)
    d.start_load(FabricMetadata(loads=[plan]))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished, failed = d.get_results(set())
        if finished:
            return finished, failed
        time.sleep(0.005)
    raise AssertionError(f"load of {req} never finished")


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def assert_nothing_held(p: FabricWorker) -> None:
    """Every per-request table is empty and no slot on P is still referenced."""
    assert p.sender is not None
    wait_for(
        lambda: all(p.sender.table_sizes()[t] == 0 for t in PER_REQUEST_TABLES),  # type: ignore[union-attr]
        f"tables never emptied: {p.sender.table_sizes()}",
    )
    p.store.drop_unused()
    assert p.store.stats().filled == 0  # NOTE: a referenced slot cannot be dropped


@pytest.mark.parametrize("kind", KINDS)
def test_a_silent_decoder_delays_no_push_to_another(
    pair: tuple[FabricWorker, FabricWorker], kind: str
) -> None:
    """Pushes to a decoder that never answers are begun first, each time;
    the real decoder's loads still succeed within a grace far shorter than
    the silent one's Reserve takes (the control timeout, 5 s)."""
    p, d = pair
    assert d.node is not None and p.sender is not None
    failures = 0
    with silent_endpoint(kind) as silent:
        for n in range(3):
            push(p, f"s{n}", silent, prompt(n))
            push(p, f"r{n}", d.node.endpoint, prompt(n))
            assert load(d, f"r{n}", prompt(n)) == ({f"r{n}"}, set())
            failures += p.counters.take().get("push_failures", 0)
            if n == 0:
                assert failures == 0  # the silent one's Hello still waits
        wait_for(
            lambda: failures + p.counters.take().get("push_failures", 0) >= 3,
            "the pushes to the silent decoder never failed",
        )
        counts = d.counters.take()
        assert counts["loads_ok"] == 3 and "load_failures" not in counts
        assert_nothing_held(p)


@pytest.mark.parametrize("pair", ["loopback"], indirect=True)
@pytest.mark.parametrize("kind", KINDS)
def test_a_thousand_pushes_to_a_dead_decoder_hold_nothing(
    pair: tuple[FabricWorker, FabricWorker], kind: str
) -> None:
    """1,100 requests toward a dead or silent decoder over ~12 s (two Hello
    timeouts, a backoff between), a push to a live one after every 100th:
    every live push lands, every dead one fails (counted), the sender's
    tables stay small and end empty, P keeps no slot."""
    p, d = pair
    assert d.node is not None and p.sender is not None
    peak: dict[str, int] = {}
    with silent_endpoint(kind) as dead:
        for n in range(1100):
            time.sleep(0.01)  # NOTE: paced, so the run spans backoffs and retries
            push(p, f"x{n}", dead, prompt(n))
            for table, size in p.sender.table_sizes().items():
                peak[table] = max(peak.get(table, 0), size)
            if n % 100 == 0:
                live = f"live{n}"
                push(p, live, d.node.endpoint, prompt(n))
                assert load(d, live, prompt(n)) == ({live}, set())
        sent = p.counters.take()
        assert_nothing_held(p)
        failed = sent.get("push_failures", 0) + p.counters.take().get("push_failures", 0)
    assert failed == 1100 and sent["chunks_sent"] == 11
    assert peak["sender_jobs"] <= MAX_WAITING + 2 and peak["sender_leases"] <= 2
    assert peak["sender_queued"] <= 4 * MAX_WAITING and peak["sender_peers"] <= 2
    assert peak["sender_links"] <= 1  # the dead one never got a link
    assert d.counters.take()["loads_ok"] == 11


def test_a_failed_decoder_is_backed_off_then_served_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a failure, pushes to the endpoint fail at once (counted) until
    its backoff ends; once it serves again a push lands and the backoff resets."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    p = worker(produce=True, seed=1)
    d: FabricWorker | None = None
    try:
        assert p.sender is not None
        push(p, "a", endpoint, prompt(0))  # nothing listens yet: fails after the Hello timeout
        wait_for(lambda: p.counters.take().get("push_failures", 0) == 1, "no failure")
        caplog.set_level(logging.DEBUG, logger="fabric.integrations.vllm.sender")
        push(p, "b", endpoint, prompt(1))
        wait_for(lambda: "failed recently" in caplog.text, "not skipped while backed off")
        assert p.counters.take()["push_failures"] == 1
        d = worker(produce=False, seed=2, kv_port=port, unknown_transfer_grace_s=GRACE_S)
        time.sleep(FIRST_BACKOFF_S)  # NOTE: the first backoff runs out
        push(p, "c", endpoint, prompt(2))
        assert load(d, "c", prompt(2)) == ({"c"}, set())
        peer = p.sender._peers[endpoint]
        wait_for(lambda: peer.backoff_s == 0, "the backoff never reset")
    finally:
        p.shutdown()
        if d is not None:
            d.shutdown()


def test_backoff_doubles_up_to_its_limit() -> None:
    peer = _Peer("tcp://x:1", lambda _: None, "test")
    delays = []
    for _ in range(8):
        peer.back_off(100.0, 30.0)
        delays.append(peer.backoff_s)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert peer.backed_off(129.0) and not peer.backed_off(130.0)
