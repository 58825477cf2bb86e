"""Direct reads through the server: a sender offers a chunk final in its paged
cache (``PeerLink.offer``), the receiver READs it into the chunk's slot and
verifies it as a written chunk (loopback plane; the NIXL one in
``test_direct_read.py``)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from fabric.errors import FabricError, ReservationRefused
from fabric.kv import KVLayout, pack
from fabric.kv.direct import CacheMap, cache_map, cache_regions, cache_spans, checksum_spans
from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode
from fabric.transfer.client import ChunkOffer
from fabric.transfer.dataplane import XferState

from .direct_peer import BLOCK_IDS, BLOCKS, cache

_names = itertools.count()


@dataclass
class Pair:
    sender: TransferNode
    receiver: TransferNode
    layers: list[torch.Tensor]
    layout: KVLayout
    nbytes: int

    @property
    def cmap(self) -> CacheMap:
        return cache_map(self.layers, self.layout)

    def checksum(self, block_ids: list[int] = BLOCK_IDS) -> int:
        spans = cache_spans(self.layers, self.layout, block_ids)
        return checksum_spans(spans.addrs, spans.lengths)

    def packed(self, block_ids: list[int] = BLOCK_IDS) -> torch.Tensor:
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        pack(self.layers, self.layout, block_ids, out)
        return out


def node(
    layout: KVLayout, nbytes: int, *, serve: bool, control_timeout_ms: int = 5000
) -> TransferNode:
    store = ChunkStore(StoreConfig(slot_bytes=nbytes, num_slots=4, quarantine_ms=10))
    config = TransferConfig(
        transport="loopback", poll_interval_ms=0.5, control_timeout_ms=control_timeout_ms
    )
    return TransferNode(
        store, config, layout.fingerprint(), name=f"offer-{next(_names)}", serve=serve
    )


@pytest.fixture
def pair() -> Iterator[Pair]:
    layers = cache(seed=3)
    layout = KVLayout.from_tensors(layers)
    nbytes = layout.chunk_nbytes(len(BLOCK_IDS))
    sender, receiver = node(layout, nbytes, serve=False), node(layout, nbytes, serve=True)
    for base, size in cache_regions(layers):
        sender.plane.register_region(base, size)
    assert receiver.server is not None
    receiver.server.enable_reads(layout)
    yield Pair(sender, receiver, layers, layout, nbytes)
    sender.close()
    receiver.close()


def test_an_offered_chunk_is_read_into_its_slot_and_verified(pair: Pair) -> None:
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t1", [b"k" * 16], [pair.nbytes])
    link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    prog = server.wait("t1", 5)
    assert prog is not None and prog.complete
    slot = pair.receiver.store.acquire([b"k" * 16])
    assert slot == [res.slots[0]]
    assert torch.equal(pair.receiver.store.pool.slot_view(slot[0]), pair.packed())
    pair.receiver.store.release_slots(slot)
    stats = server.stats
    assert (stats.chunks_read, stats.bytes_read, stats.chunks_filled) == (1, pair.nbytes, 1)


def test_a_source_changed_after_its_checksum_fails_the_chunk(pair: Pair) -> None:
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t2", [b"k" * 16], [pair.nbytes])
    checksum = pair.checksum()
    pair.layers[2][0, BLOCK_IDS[3], 0, 0, 0] += 1  # NOTE: the blocks were reused meanwhile
    link.offer(res, 0, BLOCK_IDS, checksum, pair.cmap)
    prog = server.wait("t2", 5)
    assert prog is not None and prog.failed == {0} and not prog.filled
    assert not pair.receiver.store.contains(b"k" * 16)
    assert server.stats.checksum_failures == 1


def test_offers_that_cannot_be_read_are_refused_and_counted(pair: Pair) -> None:
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t3", [b"a" * 16, b"b" * 16], [pair.nbytes, pair.nbytes])
    good = pair.checksum()
    with pytest.raises(ReservationRefused, match="outside"):
        link.offer(res, 0, [*BLOCK_IDS[:-1], BLOCKS], good, pair.cmap)  # NOTE: one past the end
    with pytest.raises(ReservationRefused, match="do not hold"):
        link.offer(res, 0, BLOCK_IDS[:-1], good, pair.cmap)
    other = CacheMap(*[getattr(pair.cmap, f) for f in ("bases", "block_strides")], 1, 32, "x")
    with pytest.raises(ReservationRefused, match="does not fit"):
        link.offer(res, 0, BLOCK_IDS, good, other)
    stale = type(res)(
        res.request_id, res.keys, res.nbytes, res.slots, (99, 99), res.already_present
    )
    with pytest.raises(ReservationRefused, match="generation"):
        link.offer(stale, 0, BLOCK_IDS, good, pair.cmap)
    link.offer(res, 0, BLOCK_IDS, good, pair.cmap)
    with pytest.raises(ReservationRefused, match="waits to be read"):
        link.offer(res, 0, BLOCK_IDS, good, pair.cmap)  # NOTE: read already
    link.offer(res, 1, BLOCK_IDS, good, pair.cmap)
    prog = server.wait("t3", 5)
    assert prog is not None and prog.complete
    assert server.stats.offers_refused == 5


def test_a_read_outside_the_senders_registered_memory_is_refused(pair: Pair) -> None:
    """A cache map pointing past what the sender registered is never read."""
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t4", [b"k" * 16], [pair.nbytes])
    far = pair.cmap
    moved = CacheMap(
        [b + (1 << 30) for b in far.bases],
        far.block_strides,
        far.segment_bytes,
        far.num_blocks,
        far.fingerprint,
    )
    with pytest.raises(ReservationRefused, match="read_failed"):
        link.offer(res, 0, BLOCK_IDS, pair.checksum(), moved)
    prog = server.wait("t4", 5)
    assert prog is not None and prog.failed == {0}
    assert server.stats.read_failures == 1


def test_a_receiver_that_does_not_read_refuses_offers(pair: Pair) -> None:
    layout = pair.layout
    plain = node(layout, pair.nbytes, serve=True)
    try:
        link = pair.sender.client.connect(plain.endpoint)
        res = link.reserve("t5", [b"k" * 16], [pair.nbytes])
        with pytest.raises(ReservationRefused, match="does not read"):
            link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    finally:
        plain.close()


def test_a_plane_that_cannot_read_is_not_enabled() -> None:
    layers = cache(seed=4)
    layout = KVLayout.from_tensors(layers)
    store = ChunkStore(StoreConfig(slot_bytes=4096, num_slots=2))
    tcp = TransferNode(store, TransferConfig(transport="tcp"), layout.fingerprint())
    try:
        assert tcp.server is not None
        with pytest.raises(FabricError, match="cannot read"):
            tcp.server.enable_reads(layout)
    finally:
        tcp.close()


class _Stuck:
    """A READ that runs until told to end (or raises when polled)."""

    def __init__(self, fail_poll: bool = False) -> None:
        self.state, self.fail_poll, self.aborted = XferState.PROC, fail_poll, False

    def poll(self) -> XferState:
        if self.fail_poll:
            raise RuntimeError("agent gone")
        return self.state

    def release(self) -> None:
        pass

    def abort(self) -> bool:
        self.aborted = True
        return True


def _offer_in_thread(pair: Pair, rid: str) -> tuple[threading.Thread, list[BaseException | None]]:
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve(rid, [rid.encode() * 4], [pair.nbytes])
    outcome: list[BaseException | None] = []

    def offer() -> None:
        try:
            link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=offer)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("how", ["release", "cancel", "poll raises"])
def test_a_read_in_flight_ends_with_its_transfer_and_frees_its_slot(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A READ still running when its consumer releases the transfer, its
    sender cancels it, or its handle breaks: aborted, answered read_failed,
    its slot no longer held as being written (nothing stays reserved)."""
    server = pair.receiver.server
    assert server is not None
    stuck = _Stuck(fail_poll=how == "poll raises")
    monkeypatch.setattr(pair.receiver.plane, "post_read", lambda *a, **k: stuck)
    thread, outcome = _offer_in_thread(pair, "t6")
    deadline = time.monotonic() + 5
    while not server.table_sizes()["server_reads"] and how != "poll raises":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    if how == "release":
        server.release("t6")
    elif how == "cancel":  # NOTE: from another link: the offering one waits for its answer
        layout = pair.layout
        other = node(layout, pair.nbytes, serve=False)
        try:
            assert other.client.connect(pair.receiver.endpoint).cancel("t6")
        finally:
            other.close()
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], ReservationRefused)
    assert "read_failed" in str(outcome[0])
    assert stuck.aborted == (how != "poll raises")
    assert server.table_sizes()["server_reads"] == 0
    server.release("t6")
    assert pair.receiver.store.reserved_count() == 0
    assert server.stats.read_failures == 1


def test_a_read_past_its_bound_is_aborted(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded by the control timeout: the sender waits no longer."""
    impatient = node(pair.layout, pair.nbytes, serve=True, control_timeout_ms=250)
    pair.receiver.close()
    pair.receiver = impatient
    server = impatient.server
    assert server is not None
    server.enable_reads(pair.layout)
    stuck = _Stuck()
    monkeypatch.setattr(impatient.plane, "post_read", lambda *a, **k: stuck)
    thread, outcome = _offer_in_thread(pair, "t7")
    thread.join(10)
    assert isinstance(outcome[0], ReservationRefused) and "not done in 0.2 s" in str(outcome[0])
    assert stuck.aborted
    prog = server.wait("t7", 1)
    assert prog is not None and prog.failed == {0}


def _wait_parts(server, rid: str, index: int, layers: int) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        prog = server.progress(rid)
        if prog is not None and prog.parts.get(index, 0) >= layers:
            return
        time.sleep(0.005)
    raise AssertionError(f"layers {layers} of chunk {index} never counted")


def test_layer_parts_are_read_as_offered_then_the_rest_verified(pair: Pair) -> None:
    """A chunk offered a layer group at a time: each part reads only the
    layers not read yet (the slot's leading bytes equal the pack's), counts
    as landed layers for a consumer that streams, and the final offer reads
    the rest and verifies the whole chunk against its checksum."""
    server = pair.receiver.server
    assert server is not None
    per_layer = pair.nbytes // pair.layout.num_layers
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t10", [b"k" * 16], [pair.nbytes])
    view = pair.receiver.store.pool.slot_view(res.slots[0])
    link.offer(res, 0, BLOCK_IDS, 0, pair.cmap, layers=1)
    _wait_parts(server, "t10", 0, 1)
    assert torch.equal(view[:per_layer], pair.packed()[:per_layer])
    assert not view[per_layer:].any()  # NOTE: nothing past the part was read
    link.offer(res, 0, BLOCK_IDS, 0, pair.cmap, layers=3)
    _wait_parts(server, "t10", 0, 3)
    assert not view[3 * per_layer :].any()
    with pytest.raises(ReservationRefused, match="nothing left"):
        link.offer(res, 0, BLOCK_IDS, 0, pair.cmap, layers=2)  # NOTE: read already
    with pytest.raises(ReservationRefused, match="layers offered"):
        link.offer(res, 0, BLOCK_IDS, 0, pair.cmap, layers=9)
    link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    prog = server.wait("t10", 5)
    assert prog is not None and prog.complete
    assert torch.equal(view, pair.packed())
    stats = server.stats
    assert (stats.parts_read, stats.chunks_read, stats.bytes_read) == (2, 1, pair.nbytes)
    assert (stats.offers_refused, stats.chunks_filled) == (2, 1)


def test_the_final_read_of_a_streamed_chunk_says_where_it_began(pair: Pair) -> None:
    """A consumer that unpacks the parts as they land (``stream``) is handed
    the checksum with the first byte the final read carried: past what it
    read, so its digest of the parts counts (``fill_streamed``)."""
    server = pair.receiver.server
    assert server is not None
    per_layer = pair.nbytes // pair.layout.num_layers
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t11", [b"k" * 16], [pair.nbytes])
    link.offer(res, 0, BLOCK_IDS, 0, pair.cmap, layers=2)
    _wait_parts(server, "t11", 0, 2)
    assert server.stream("t11", 0)
    link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    deadline = time.monotonic() + 5
    while (prog := server.progress("t11")) is not None and 0 not in prog.sealed:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert prog is not None
    assert prog.sealed[0] == (pair.checksum(), res.generations[0], 2 * per_layer)
    slot = res.slots[0]
    import xxhash

    digest = xxhash.xxh3_64(pair.receiver.store.pool.slot_view(slot).numpy().data).intdigest()
    assert server.fill_streamed("t11", 0, prog.sealed[0], (slot, digest))
    assert server.wait("t11", 5).complete  # type: ignore[union-attr]


def test_a_part_read_before_its_source_was_final_fails_the_chunk(pair: Pair) -> None:
    """Layers read in a part that are not what the final checksum covers (the
    prefiller's blocks changed under the part) fail the chunk, not load it."""
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t12", [b"k" * 16], [pair.nbytes])
    checksum = pair.checksum()
    pair.layers[0][0, BLOCK_IDS[0], 0, 0, 0] += 1  # NOTE: layer 0 differs from what was hashed
    link.offer(res, 0, BLOCK_IDS, 0, pair.cmap, layers=1)
    pair.layers[0][0, BLOCK_IDS[0], 0, 0, 0] -= 1  # NOTE: the rest read is as hashed
    link.offer(res, 0, BLOCK_IDS, checksum, pair.cmap)
    prog = server.wait("t12", 5)
    assert prog is not None and prog.failed == {0} and not prog.filled
    assert server.stats.checksum_failures == 1


def test_an_offer_whose_cache_cannot_be_loaded_is_refused(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender's cache is named in its Offers only (not in the descriptor
    its Hello carries): an Offer whose region descriptor does not load, or
    names regions its sender did not register, is refused and nothing read."""
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t13", [b"k" * 16], [pair.nbytes])
    plane = pair.sender.client.plane
    real = plane.region_descriptor()
    monkeypatch.setattr(plane, "region_descriptor", lambda peer=None: b"junk")
    with pytest.raises(ReservationRefused, match="sender's cache"):
        link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    forged = real.replace(plane.name.encode(), pair.receiver.client.plane.name.encode())
    monkeypatch.setattr(plane, "region_descriptor", lambda peer=None: forged)
    with pytest.raises(ReservationRefused, match="sender's cache"):
        link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    monkeypatch.setattr(plane, "region_descriptor", lambda peer=None: real)
    link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    prog = server.wait("t13", 5)
    assert prog is not None and prog.complete
    assert server.stats.offers_refused == 2 and server.stats.chunks_read == 1


def test_a_second_connection_of_the_sender_does_not_strand_the_first(pair: Pair) -> None:
    """A Hello loads the sender's descriptor anew, which resets the regions the
    receiver's plane holds for that agent (as NIXL's loading does), for every
    connection of it: the first connection's next Offer loads them again
    instead of reading outside what it was given."""
    import zmq

    from fabric.transfer import protocol as proto

    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t14", [b"a" * 16, b"b" * 16], [pair.nbytes, pair.nbytes])
    link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)  # NOTE: regions loaded
    plane, codec = pair.sender.client.plane, pair.sender.client.codec
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pair.receiver.endpoint)
    try:
        hello = proto.Hello(
            1, plane.name, plane.kind, pair.layout.fingerprint(), plane.descriptor()
        )
        sock.send(codec.encode(hello))
        assert sock.poll(5000) and isinstance(codec.decode(sock.recv()), proto.HelloAck)
    finally:
        sock.close()
    link.offer(res, 1, BLOCK_IDS, pair.checksum(), pair.cmap)
    prog = server.wait("t14", 5)
    assert prog is not None and prog.complete and server.stats.read_failures == 0


def test_an_offer_is_not_resent_to_a_process_that_did_not_grant_its_reservation(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver that answers no_hello may be a new process on the endpoint
    (a restart, a port taken over): the link says Hello again, and when its
    agent is another one the Offer, which names this side's cache, is not
    sent to it; the push fails instead."""
    from fabric.transfer import protocol as proto
    from fabric.transfer.dataplane import LoopbackDataPlane

    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t15", [b"k" * 16], [pair.nbytes])
    other = LoopbackDataPlane("offer-new-process")
    sent: list[proto.Message] = []
    try:
        ack = proto.HelloAck(
            0, other.name, other.kind, pair.layout.fingerprint(), other.descriptor(), 1, 1
        )

        def call(msgs: list[proto.Message], tick: object = None) -> list[proto.Message]:
            sent.extend(msgs)
            return [
                proto.Refused(msg.seq, "", proto.Refusal.NO_HELLO, "who are you")  # type: ignore[attr-defined]
                for msg in msgs
            ]

        monkeypatch.setattr(link, "_call_many", call)
        monkeypatch.setattr(link, "_handshake", lambda: ack)
        with pytest.raises(ReservationRefused, match="another process"):
            link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
        assert len(sent) == 1  # NOTE: not sent again to the new process
    finally:
        other.close()


def test_no_offer_beyond_loopback_without_a_secret(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unsigned, a Hello's and a Reserve's answers prove nothing: an Offer (it
    names this side's cache) goes beyond loopback only with a secret (or
    ``insecure``), as a receiver binds beyond loopback only with one."""
    link = pair.sender.client.connect(pair.receiver.endpoint)
    res = link.reserve("t16", [b"k" * 16], [pair.nbytes])
    monkeypatch.setattr(link, "endpoint", "tcp://10.9.8.7:5555")
    with pytest.raises(ReservationRefused, match="beyond loopback"):
        link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)
    monkeypatch.setattr(link, "endpoint", pair.receiver.endpoint)
    link.offer(res, 0, BLOCK_IDS, pair.checksum(), pair.cmap)


def test_offers_sent_together_are_each_read_and_one_refused_fails_the_call(pair: Pair) -> None:
    """``offer_many``: several chunks offered back to back, each read as it
    comes and answered on its own; the call returns once every answer came.
    One refused among them raises (the others were read and verified: their
    answers came first), and it can be offered again alone. A chunk offered
    twice in one call is refused before anything goes."""
    server = pair.receiver.server
    assert server is not None
    link = pair.sender.client.connect(pair.receiver.endpoint)
    keys = [bytes([65 + i]) * 16 for i in range(3)]
    res = link.reserve("t20", keys, [pair.nbytes] * 3)
    good = pair.checksum()
    with pytest.raises(ValueError, match="twice"):
        link.offer_many(
            res, [ChunkOffer(0, BLOCK_IDS, good), ChunkOffer(0, BLOCK_IDS, good)], pair.cmap
        )
    past_the_end = [*BLOCK_IDS[:-1], BLOCKS]
    offers = [
        ChunkOffer(0, BLOCK_IDS, good),
        ChunkOffer(1, past_the_end, good),
        ChunkOffer(2, BLOCK_IDS, good),
    ]
    with pytest.raises(ReservationRefused, match="outside"):
        link.offer_many(res, offers, pair.cmap)
    # NOTE: it raised once the others were read (counted before their answers went)
    assert server.stats.bytes_read == 2 * pair.nbytes
    prog = server.wait_until("t20", lambda p: p.filled == {0, 2}, 5)
    assert prog is not None and prog.filled == {0, 2} and not prog.failed
    assert server.stats.chunks_read == 2 and server.stats.offers_refused == 1
    link.offer_many(res, [ChunkOffer(1, BLOCK_IDS, good)], pair.cmap)
    prog = server.wait("t20", 5)
    assert prog is not None and prog.complete
    for key in keys:
        slot = pair.receiver.store.acquire([key])
        assert len(slot) == 1 and torch.equal(
            pair.receiver.store.pool.slot_view(slot[0]), pair.packed()
        )
        pair.receiver.store.release_slots(slot)
    assert (server.stats.chunks_read, server.stats.chunks_filled) == (3, 3)
