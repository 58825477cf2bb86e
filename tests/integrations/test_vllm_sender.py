"""PushSender: every slot ref released exactly once; a slow or dead decoder
stalls only its own pushes; a dead one is backed off (once per outage) and
holds nothing; a control timeout costs no other push its write."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from fabric.errors import ReservationRefused
from fabric.integrations.vllm import sender as sender_module
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import FabricCounters
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, PackChunk, SendPlan
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
from fabric.transfer import RemoteReservation, TransferClient, TransferConfig, TransferNode
from fabric.transfer import protocol as proto
from fabric.transfer.dataplane import LoopbackDataPlane, Segment, WriteFence, WriteHandle, XferState
from tests.transfer.patterns import FINGERPRINT, fill_store
from tests.transfer.silent import KINDS, SLOT, FakeReceiver, gated_endpoint, silent_endpoint

HANG_S = 30  # NOTE: a guard against hangs, never a bound a test should meet


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
    peer = _Peer(job.endpoint, sender._serve, "test", "test")  # NOTE: never started
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
PER_REQUEST_TABLES = ("sender_jobs", "sender_queued", "sender_leases", "sender_cancels")


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
    p.pack_step(FabricMetadata(sends=[send], packs=[PackChunk(req, 0, [3, 4, 5, 6])]))
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


def slow_control(w: FabricWorker) -> None:
    """Calls time out only after any test has ended: a gated receiver fails
    them when the test says so, never because the test ran slowly."""
    assert w.node is not None
    w.node.client.config = w.node.client.config.model_copy(update={"control_timeout_ms": 120_000})


class Tally:
    """Counts taken from ``counters`` so far, summed (``take`` resets them)."""

    def __init__(self, counters: FabricCounters) -> None:
        self.counters, self.total = counters, Counter[str]()

    def __getitem__(self, name: str) -> int:
        for key, value in self.counters.take().items():
            if isinstance(value, int):
                self.total[key] += value
        return self.total[name]


def holds_no_slot(p: FabricWorker) -> bool:
    p.store.drop_unused()
    return p.store.stats().filled == 0  # NOTE: a referenced slot cannot be dropped


@pytest.mark.parametrize("kind", KINDS)
def test_a_silent_decoder_delays_no_push_to_another(
    pair: tuple[FabricWorker, FabricWorker], kind: str
) -> None:
    """Pushes to a decoder that never answers are begun first, each time;
    the real decoder's loads all succeed while the silent one still holds
    the first Hello (until the test lets it refuse)."""
    p, d = pair
    assert d.node is not None and p.sender is not None
    slow_control(p)
    sent = Tally(p.counters)
    with gated_endpoint(kind) as gate:
        for n in range(3):
            push(p, f"s{n}", gate.endpoint, prompt(n))
            push(p, f"r{n}", d.node.endpoint, prompt(n))
            assert load(d, f"r{n}", prompt(n)) == ({f"r{n}"}, set())
        assert sent["push_failures"] == 0  # the silent one's Hello still waits
        gate.refuse()
        wait_for(lambda: sent["push_failures"] >= 3, "the pushes to the silent one never failed")
        assert sent["push_failures"] == 3 and sent["chunks_sent"] == 3
        counts = d.counters.take()
        assert counts["loads_ok"] == 3 and "load_failures" not in counts
        assert_nothing_held(p)


def press(store: ChunkStore) -> list[int]:
    """Take slots (local allocations) until a few under a quarter could be
    allocated (so the slot a released push gives back keeps it pressed)."""
    total = store.allocatable()[1]
    assert sender_module.STALL_PRESSURE * total > sender_module.MIN_FREE_SLOTS + 4
    taken = []
    while store.allocatable()[0] >= sender_module.STALL_PRESSURE * total - 4:
        taken.append(store.allocate(b"press-%08d" % len(taken) + b"\0" * 3))
    return taken


@pytest.mark.parametrize("kind", KINDS)
def test_pushes_waiting_on_a_stalled_decoder_keep_their_chunks_until_the_store_is_short(
    kind: str,
) -> None:
    """While the first Hello to a silent decoder waits (far longer than the
    test), the pushes waiting behind it keep their chunks as long as the
    store has room (a decoder that is only slow answers later, and its
    pushes land: seen on a busy 2-core host, where 1 s stalls failed them);
    once under a quarter of the store's slots could be allocated, the
    chunks are released: those already handed over, later ones as they
    come. Each push fails (counted) once its thread gets to it."""
    p = worker(produce=True, seed=1)
    taken: list[int] = []
    try:
        slow_control(p)
        assert p.sender is not None
        p.sender.max_unsettled_s = 600.0  # NOTE: only the store's pressure releases here
        sent = Tally(p.counters)
        with gated_endpoint(kind) as gate:
            push(p, "s0", gate.endpoint, prompt(0))
            time.sleep(3 * sender_module.STALL_S)  # stalled, and the store has room
            assert not holds_no_slot(p), "a slow decoder's push lost its chunk"
            assert sent["push_failures"] == 0
            taken = press(p.store)
            wait_for(lambda: holds_no_slot(p), "a stalled push kept its chunk", HANG_S)
            push(p, "s1", gate.endpoint, prompt(1))
            wait_for(lambda: holds_no_slot(p), "a push to a stalled decoder kept its chunk")
            assert sent["push_failures"] == 0  # the Hello still waits
            gate.refuse()
            wait_for(lambda: sent["push_failures"] >= 2, "the stalled pushes never failed")
            assert sent["push_failures"] == 2
            for slot in taken:
                p.store.abort(slot)
            taken = []
            assert_nothing_held(p)
    finally:
        for slot in taken:
            p.store.abort(slot)
        p.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_push_waiting_too_long_for_its_reserve_gives_its_chunks_back(kind: str) -> None:
    """With the store at ease, a push whose Reserve has not come within
    ``max_unsettled_s`` (its decoder stopped waiting by then) releases its
    chunks anyway; it fails once its thread gets to it."""
    p = worker(produce=True, seed=1)
    try:
        slow_control(p)
        assert p.sender is not None
        p.sender.max_unsettled_s = 600.0
        sent = Tally(p.counters)
        with gated_endpoint(kind) as gate:
            push(p, "s0", gate.endpoint, prompt(0))
            assert not holds_no_slot(p)
            p.sender.max_unsettled_s = 0.5  # NOTE: the next tend finds it over age
            wait_for(lambda: holds_no_slot(p), "a push waiting for ever kept its chunk", HANG_S)
            assert sent["push_failures"] == 0  # the Hello still waits
            gate.refuse()
            wait_for(lambda: sent["push_failures"] >= 1, "the push never failed")
            assert_nothing_held(p)
    finally:
        p.shutdown()


@pytest.mark.parametrize("pair", ["loopback"], indirect=True)
@pytest.mark.parametrize("kind", KINDS)
def test_a_thousand_pushes_to_a_dead_decoder_hold_nothing(
    pair: tuple[FabricWorker, FabricWorker], kind: str
) -> None:
    """1,100 requests toward a dead or silent decoder over ~12 s (two Hello
    timeouts, a backoff between), a push to a live one after every 100th:
    every live push lands (its tail observed), every dead one fails
    (counted), the sender's tables stay small and end empty, P keeps no slot."""
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
        later = p.counters.take()
        failed = sent.get("push_failures", 0) + later.get("push_failures", 0)
    assert failed == 1100 and sent["chunks_sent"] == 11
    # NOTE: a tail per complete push, the live ones'; a failed push has none
    tails = [*sent.get("push_tail_seconds", []), *later.get("push_tail_seconds", [])]
    assert len(tails) == 11 and all(0 < t < 30 for t in tails)
    assert peak["sender_jobs"] <= MAX_WAITING + 2 and peak["sender_leases"] <= 2
    assert peak["sender_queued"] <= 4 * MAX_WAITING and peak["sender_peers"] <= 2
    assert peak["sender_links"] <= 1  # the dead one never got a link
    assert d.counters.take()["loads_ok"] == 11


def fail_a_push(p: FabricWorker, endpoint: str) -> None:
    """Push request "a" to ``endpoint``, where nothing listens yet: it fails
    after the Hello timeout and backs the endpoint off."""
    push(p, "a", endpoint, prompt(0))
    wait_for(lambda: p.counters.take().get("push_failures", 0) == 1, "no failure")


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
        fail_a_push(p, endpoint)
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


def test_a_backed_off_decoder_that_answers_again_gets_the_next_push(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decoder back from an outage (a partition healed, a restart) gets the
    next push as soon as it answers, not once its backoff ran out."""
    monkeypatch.setattr(sender_module, "FIRST_BACKOFF_S", 600.0)  # NOTE: outlasts the test
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    p = worker(produce=True, seed=1)
    d: FabricWorker | None = None
    try:
        assert p.sender is not None
        p.sender.backoff_s = 600.0  # NOTE: and its cap
        fail_a_push(p, endpoint)
        peer = p.sender._peers[endpoint]
        assert peer.backoff_s == 600.0
        assert peer.backed_off(time.monotonic())
        d = worker(produce=False, seed=2, kv_port=port, unknown_transfer_grace_s=GRACE_S)
        wait_for(lambda: not peer.backed_off(time.monotonic()), "never found it answering", HANG_S)
        push(p, "c", endpoint, prompt(2))
        assert load(d, "c", prompt(2)) == ({"c"}, set())
        wait_for(lambda: peer.backoff_s == 0, "the backoff never reset")
    finally:
        p.shutdown()
        if d is not None:
            d.shutdown()


def test_backoff_doubles_up_to_its_limit() -> None:
    peer = _Peer("tcp://x:1", lambda _: None, "test", "test")
    delays = []
    for _ in range(8):
        peer.back_off(100.0, 30.0)
        delays.append(peer.backoff_s)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert peer.backed_off(129.0) and not peer.backed_off(130.0)


# ---------------------------------------------------------------- hand-driven receivers
# A PushSender over a real TransferClient and a FakeReceiver (ZMQ ROUTER
# answered by the test), or a real TransferNode.

KEY = b"k" * 32
_names = itertools.count()


@pytest.fixture
def fake() -> Iterator[FakeReceiver]:
    receiver = FakeReceiver()
    yield receiver
    receiver.close()


def node(*, serve: bool, **config: object) -> TransferNode:
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=16, quarantine_ms=10))
    cfg = TransferConfig(transport="loopback", **config)  # type: ignore[arg-type]
    return TransferNode(store, cfg, FINGERPRINT, name=f"push-{next(_names)}", serve=serve)


def grant(msg: proto.Message, slot: int = 0) -> proto.Reserved:
    assert isinstance(msg, proto.Reserve)
    slots = list(range(slot, slot + len(msg.keys)))
    present = [False] * len(slots)
    return proto.Reserved(msg.seq, msg.request_id, slots, slots, present, msg.lease_ms)


def hand_over(sender: PushSender, store: ChunkStore, req_id: str, index: int, key: bytes) -> None:
    """What the model thread does once chunk ``index`` (``key``) is packed."""
    sender.chunk(req_id, index, store.acquire([key])[0])


def test_one_outage_backs_a_decoder_off_once(
    fake: FakeReceiver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Three pushes hold reservations on a decoder that then stops
    answering: each one's heartbeat times out, one after another, but the
    outage backs the decoder off once (not thrice: 30, 60, 60 s)."""
    monkeypatch.setattr(sender_module, "FIRST_BACKOFF_S", 30.0)  # NOTE: outlasts the test
    caplog.set_level(logging.WARNING, logger="fabric.integrations.vllm.sender")
    n = node(serve=False, control_timeout_ms=300)
    counters = FabricCounters()
    sender = PushSender(n.client, n.store, counters, lease_ms=900, push_timeout_s=60, backoff_s=60)
    try:
        for i in range(3):
            sender.begin(PushJob(f"r{i}", f"t{i}", fake.endpoint, [KEY], [SLOT]))
        fake.answer_hello()
        for _ in range(3):
            identity, reserve = fake.recv()
            fake.reply(identity, grant(reserve))
        # NOTE: silent from here on: no heartbeat is answered
        sent = Tally(counters)
        wait_for(lambda: sent["push_failures"] == 3, "the pushes never failed", HANG_S)
        assert sender._peers[fake.endpoint].backoff_s == 30.0
        assert caplog.text.count("fail at once for") == 1
    finally:
        sender.close()
        n.close()


def test_an_error_from_a_dropped_link_leaves_the_new_one_alone() -> None:
    """Push A (reserved, waiting for its second chunk) keeps the link it
    had after that link was dropped; its next heartbeat fails on it. That
    is no news about the receiver: push B, on the new link, lands, the
    endpoint is not backed off, and the new link stays."""
    receiver, n = node(serve=True), node(serve=False)
    counters = FabricCounters()
    sender = PushSender(n.client, n.store, counters, lease_ms=600, push_timeout_s=60)
    try:
        keys, _ = fill_store(n, 1, 3, SLOT)
        sent = Tally(counters)
        sender.begin(PushJob("A", "t-A", receiver.endpoint, keys[:2], [SLOT, SLOT]))
        hand_over(sender, n.store, "A", 0, keys[0])
        wait_for(lambda: sent["chunks_sent"] == 1, "A's first chunk never went", HANG_S)
        old = n.client.current_link(receiver.endpoint)
        n.client.disconnect(receiver.endpoint)
        sender.begin(PushJob("B", "t-B", receiver.endpoint, keys[2:], [SLOT]))
        hand_over(sender, n.store, "B", 0, keys[2])
        wait_for(lambda: sent["chunks_sent"] + sent["push_failures"] >= 3, "no outcome", HANG_S)
        assert sent["push_failures"] == 1 and sent["chunks_sent"] == 2  # A failed, B landed
        assert receiver.server is not None
        prog = receiver.server.wait("t-B", HANG_S)
        assert prog is not None and prog.complete
        link = n.client.current_link(receiver.endpoint)
        assert link is not None and link is not old and not link.closed
        assert sender._peers[receiver.endpoint].backoff_s == 0
    finally:
        sender.close()
        n.close()
        receiver.close()


class _Held(WriteHandle):
    def __init__(self) -> None:
        self.state = XferState.PROC

    def poll(self) -> XferState:
        return self.state


class HeldPlane(LoopbackDataPlane):
    """Loopback writes that stay in flight until ``land``; ``remove_peer``
    fails those to that peer, as a stopped TCP sender or a removed NIXL
    agent does."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.writes: list[tuple[str, _Held]] = []
        self.removed: list[str] = []

    def post_write(
        self,
        peer: str,
        segments: Sequence[Segment],
        notif: bytes,
        fence: WriteFence | None = None,
    ) -> WriteHandle:
        super().post_write(peer, segments, notif, fence)
        handle = _Held()
        self.writes.append((peer, handle))
        return handle

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)
        for to, handle in self.writes:
            if to == peer and handle.state is XferState.PROC:
                handle.state = XferState.ERR

    def land(self) -> None:
        for _, handle in self.writes:
            if handle.state is XferState.PROC:
                handle.state = XferState.DONE


@pytest.fixture
def held() -> Iterator[tuple[TransferClient, HeldPlane]]:
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=16))
    plane = HeldPlane(f"held-{next(_names)}")
    plane.register_pool(store.pool.base_address, store.pool.nbytes)
    client = TransferClient(store, plane, TransferConfig(control_timeout_ms=300), FINGERPRINT)
    yield client, plane
    client.close()
    plane.close()


def fill_store_of(store: ChunkStore, n: int) -> tuple[list[bytes], list[int]]:
    keys = [bytes([i]) * 32 for i in range(n)]
    slots = []
    for key in keys:
        slot = store.allocate(key)
        store.commit(slot, key, SLOT)
        slots.append(slot)
    return keys, slots


def test_a_control_timeout_costs_no_other_push_its_write(
    fake: FakeReceiver, held: tuple[TransferClient, HeldPlane]
) -> None:
    """Push A's write is in flight when push B's Reserve to the same decoder
    times out (which takes the backoff to its limit at once): the
    data-plane peer stays, A's write lands and A completes."""
    client, plane = held
    counters = FabricCounters()
    sender = PushSender(
        client, client.store, counters, lease_ms=30_000, push_timeout_s=60, backoff_s=1.0
    )
    try:
        keys, _ = fill_store_of(client.store, 2)
        sent = Tally(counters)
        sender.begin(PushJob("A", "t-A", fake.endpoint, keys[:1], [SLOT]))
        hand_over(sender, client.store, "A", 0, keys[0])
        fake.answer_hello()
        identity, reserve = fake.recv()
        fake.reply(identity, grant(reserve))
        wait_for(lambda: len(plane.writes) == 1, "A's write was never posted", HANG_S)
        sender.begin(PushJob("B", "t-B", fake.endpoint, keys[1:], [SLOT]))
        _, reserve_b = fake.recv()  # NOTE: never answered
        assert isinstance(reserve_b, proto.Reserve) and reserve_b.request_id == "t-B"
        wait_for(lambda: sent["push_failures"] >= 1, "B's Reserve never timed out", HANG_S)
        plane.land()
        wait_for(lambda: sent["chunks_sent"] + sent["push_failures"] >= 2, "A never ended", HANG_S)
        assert sent["chunks_sent"] == 1 and sent["push_failures"] == 1
        assert plane.removed == [] and client.current_link(fake.endpoint) is not None
    finally:
        sender.close()


def test_a_decoder_dead_for_long_keeps_no_link(fake: FakeReceiver) -> None:
    """Once its backoff is at its limit and nothing is in flight to it, the
    link (and its data-plane peer) goes; the next push says Hello again."""
    n = node(serve=False, control_timeout_ms=300)
    counters = FabricCounters()
    sender = PushSender(
        n.client, n.store, counters, lease_ms=900, push_timeout_s=60, backoff_s=FIRST_BACKOFF_S
    )
    try:
        sender.begin(PushJob("A", "t-A", fake.endpoint, [KEY], [SLOT]))
        fake.answer_hello()
        identity, reserve = fake.recv()
        fake.reply(identity, grant(reserve))
        sent = Tally(counters)
        wait_for(lambda: sent["push_failures"] == 1, "the heartbeat never failed", HANG_S)
        wait_for(lambda: n.client.table_sizes()["links"] == 0, "the link stayed", HANG_S)
    finally:
        sender.close()
        n.close()


def test_a_reserve_that_timed_out_is_cancelled(fake: FakeReceiver) -> None:
    """The receiver may have granted a Reserve whose answer came too late:
    the sender cancels it (a Hello first, on its rebuilt socket) instead of
    leaving the receiver to hold the slots and wait for the writes."""
    n = node(serve=False, control_timeout_ms=300)
    counters = FabricCounters()
    sender = PushSender(n.client, n.store, counters, lease_ms=30_000, push_timeout_s=60)
    try:
        sender.begin(PushJob("r", "t-r", fake.endpoint, [KEY], [SLOT]))
        fake.answer_hello()
        first, reserve = fake.recv()  # NOTE: never answered
        assert isinstance(reserve, proto.Reserve) and reserve.request_id == "t-r"
        identity, hello = fake.recv(HANG_S)
        assert identity != first and isinstance(hello, proto.Hello)
        again, cancel = fake.recv(HANG_S)
        assert again == identity and isinstance(cancel, proto.Cancel)
        assert cancel.request_id == "t-r"
        assert Tally(counters)["push_failures"] == 1
    finally:
        sender.close()
        n.close()


def test_a_push_between_chunks_sleeps_but_heartbeats_on_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push whose next chunk is still being computed (a long prefill on
    the engine's core) has nothing to poll: its endpoint's thread sleeps
    until an event or its next heartbeat, at most ``IDLE_ROUND_S`` (the old
    loop: 20 rounds a second). Where that is longer than the lease (here 5 s
    against 3 s), its heartbeats still go every lease/3, and the
    reservation outlives a 4 s wait for the chunk."""
    receiver, n = node(serve=True), node(serve=False)
    counters = FabricCounters()
    rounds: list[float] = []
    for lease_ms, idle_round_s, wait_s in (
        (30_000, sender_module.IDLE_ROUND_S, 1.5),
        (3000, 5.0, 4.0),
    ):
        monkeypatch.setattr(sender_module, "IDLE_ROUND_S", idle_round_s)
        sender = PushSender(n.client, n.store, counters, lease_ms=lease_ms, push_timeout_s=60)
        real_round = sender._round

        def counted(peer: _Peer, real: Callable[[_Peer], None] = real_round) -> None:
            rounds.append(time.monotonic())
            real(peer)

        monkeypatch.setattr(sender, "_round", counted)
        try:
            keys, _ = fill_store(n, 10 + lease_ms % 7, 2, SLOT)
            sent = Tally(counters)
            tid = f"t-{lease_ms}"
            sender.begin(PushJob(f"r-{lease_ms}", tid, receiver.endpoint, keys, [SLOT, SLOT]))
            hand_over(sender, n.store, f"r-{lease_ms}", 0, keys[0])
            wait_for(lambda s=sent: s["chunks_sent"] == 1, "the first chunk never went", HANG_S)
            time.sleep(0.2)
            start = time.monotonic()
            time.sleep(wait_s)  # NOTE: the prefill computes the next chunk
            between = [t for t in rounds if start <= t < start + wait_s]
            assert receiver.server is not None
            assert receiver.server.store.has_reservation(tid), "the lease ran out"
            if lease_ms == 30_000:
                # NOTE: 3 at IDLE_ROUND_S; a busy machine only makes fewer
                assert len(between) <= 6, f"{len(between)} rounds in 1.5 s with nothing to do"
            hand_over(sender, n.store, f"r-{lease_ms}", 1, keys[1])
            prog = receiver.server.wait(tid, HANG_S)
            assert prog is not None and prog.complete and sent["push_failures"] == 0
            receiver.server.release(tid)
        finally:
            sender.close()
    receiver.close()
    n.close()


def test_an_offers_event_is_cut_to_size_and_a_failed_round_trip_ends_its_push() -> None:
    """``offer_parts`` hands a request's layer group over as one ``offers``
    event: the endpoint thread cuts it into batches as ``_take_offers``
    would (``MAX_OFFER_BATCH`` offers, ``_batch_bytes``, one at least), a
    round trip each, in order; the first that fails fails the push and the
    rest are not offered; an event of a push that is over is dropped."""
    store = ChunkStore(StoreConfig(slot_bytes=64, num_slots=4))
    counters = FabricCounters()
    sender = PushSender(None, store, counters, lease_ms=1000, push_timeout_s=5)  # type: ignore[arg-type]
    sender.close()
    peer = _Peer("tcp://x:1", sender._serve, "test", "test")  # NOTE: never started
    mib = 1 << 20
    n = sender_module.MAX_OFFER_BATCH + 2
    job = PushJob("a", "ta", peer.endpoint, [KEY] * n, [SLOT] * n)
    job.res = RemoteReservation(
        "ta", (KEY,) * n, (200 * mib,) + (mib,) * (n - 1), tuple(range(n)), (1,) * n, (False,) * n
    )

    def parts(*indices: int) -> list[tuple]:
        return [(job, i, [i], 0, time.monotonic(), 2) for i in indices]

    sender.num_layers = 4  # NOTE: a part of 2 layers reads half a chunk
    batches = sender._offer_batches(peer, parts(*range(n)))
    # NOTE: 100 MiB alone (over 64 MiB, the unmeasured rate's batch), then 16, then 1
    assert [[o[1] for o in b] for b in batches] == [[0], list(range(1, n - 1)), [n - 1]]
    assert [len(b) for b in sender._offer_batches(peer, parts(3, 4))] == [2]

    calls: list[list[int]] = []

    class Refusing:
        closed = True  # NOTE: no Cancel goes from it

        def offer_many(self, res: object, offers: list[object], cache: object) -> None:
            calls.append([o.index for o in offers])  # type: ignore[attr-defined]
            raise ReservationRefused("the receiver would not read it")

    sender.cache = object()  # type: ignore[assignment]
    job.link = Refusing()  # type: ignore[assignment]
    sender._handle_guarded(peer, "offers", parts(*range(n)))
    assert calls == [[0]] and job.failed
    assert counters.take()["push_failures"] == 1
    # NOTE: a push that is over (or failed at once): its event is dropped, nothing queued
    sender._dispatch("offers", ("gone", [(0, [0], 0, time.monotonic(), 2)]))
    assert peer.events.empty()


def test_offers_go_together_only_of_one_push_each_chunk_once_in_queue_order() -> None:
    """What ``_take_offers`` puts in one round trip: the offers queued right
    behind the first, of the same push, each chunk once (a second offer of a
    chunk, its next layer group, waits for the first's answer); the event
    that ends the batch is handled next, nothing skipped or reordered."""
    store = ChunkStore(StoreConfig(slot_bytes=64, num_slots=4))
    sender = PushSender(None, store, FabricCounters(), lease_ms=1000, push_timeout_s=5)  # type: ignore[arg-type]
    sender.close()
    peer = _Peer("tcp://x:1", sender._serve, "test", "test")  # NOTE: never started
    a, b = (
        PushJob("a", "ta", peer.endpoint, [KEY], [SLOT]),
        PushJob("b", "tb", peer.endpoint, [KEY], [SLOT]),
    )

    def offer(job: PushJob, index: int, layers: int = 0) -> tuple[str, tuple]:
        return ("offer", (job, index, [index], 0, time.monotonic(), layers))

    first, *rest = [offer(a, 0, 2), offer(a, 1, 2), offer(a, 0, 4), offer(a, 2)]
    for event in rest:
        peer.events.put(event)
    offers, after = sender._take_offers(peer, first)
    assert [(o[1], o[5]) for o in offers] == [(0, 2), (1, 2)] and after == rest[1]
    offers, after = sender._take_offers(peer, rest[1])
    assert [o[1] for o in offers] == [0, 2] and after is sender_module._NO_EVENT
    for event in (offer(b, 0), ("finished", "a")):
        peer.events.put(event)
    offers, after = sender._take_offers(peer, offer(a, 1))
    assert [o[1] for o in offers] == [1] and after[1][0] is b  # type: ignore[index]
    offers, after = sender._take_offers(peer, after)  # type: ignore[arg-type]
    assert [o[1] for o in offers] == [0] and after == ("finished", "a")
    assert peer.events.empty()
    for i in range(sender_module.MAX_OFFER_BATCH + 2):
        peer.events.put(offer(a, 10 + i))
    offers, after = sender._take_offers(peer, offer(a, 9))
    assert len(offers) == sender_module.MAX_OFFER_BATCH
    assert after[1][1] == 9 + sender_module.MAX_OFFER_BATCH  # type: ignore[index]
    while not peer.events.empty():
        peer.events.get_nowait()
    # NOTE: and MAX_OFFER_BATCH_BYTES of whole chunks at most
    mib = 1 << 20
    c = PushJob("c", "tc", peer.endpoint, [KEY] * 3, [SLOT] * 3)
    c.res = RemoteReservation(
        "tc", (KEY,) * 3, (200 * mib, 56 * mib, mib), (0, 1, 2), (1, 1, 1), (False,) * 3
    )
    for event in (offer(c, 1), offer(c, 2)):
        peer.events.put(event)
    # NOTE: the receiver's read rate not known yet: UNMEASURED_RATE, 64 MiB a batch
    offers, after = sender._take_offers(peer, offer(c, 0))
    assert [o[1] for o in offers] == [0] and after[1][1] == 1  # type: ignore[index]
    offers, after = sender._take_offers(peer, after)  # type: ignore[arg-type]
    assert [o[1] for o in offers] == [1, 2] and after is sender_module._NO_EVENT
    sender._note_rate(peer, 64 * mib, 0.01)  # NOTE: 6.7 GB/s: MAX_OFFER_BATCH_BYTES
    for event in (offer(c, 1), offer(c, 2)):
        peer.events.put(event)
    offers, after = sender._take_offers(peer, offer(c, 0))
    assert [o[1] for o in offers] == [0, 1] and after[1][1] == 2  # type: ignore[index]
    # NOTE: a chunk's later offers name only the layers not offered yet
    sender.num_layers = 4
    assert sender._offered(c, 0, 1) == 50 * mib and sender._read_bytes(c, 0, 0) == 150 * mib
    assert sender._offered(c, 0, 0) == 150 * mib and sender._read_bytes(c, 0, 0) == 0
