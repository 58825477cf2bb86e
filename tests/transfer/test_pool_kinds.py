"""Links between pools in host memory and in VRAM: each side hashes chunks
where its pool lives (xxh3 on the host, fold64 in VRAM), so a Hello and its
HelloAck say which, and each side refuses a peer that hashes the other way
(every chunk would fail). "VRAM" is host memory posing as a GPU's (fabric.testing.host_vram)."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from fabric.errors import LayoutMismatch
from fabric.kv.fold64 import fold64_reference
from fabric.store import ChunkPool, ChunkStore, StoreConfig
from fabric.testing.host_vram import host_backed_vram
from fabric.transfer import TransferConfig, TransferNode
from fabric.transfer import protocol as proto
from fabric.transfer.server import TransferServer

from .patterns import FINGERPRINT, chunk_bytes, fill_store

SLOT = 16 << 10
_names = itertools.count()


def make_node(device: str, *, serve: bool) -> TransferNode:
    store = ChunkStore(
        StoreConfig(slot_bytes=SLOT, num_slots=8, quarantine_ms=10),
        ChunkPool(8, SLOT, device=device),
    )
    config = TransferConfig(transport="loopback", poll_interval_ms=0.5)
    return TransferNode(store, config, FINGERPRINT, name=f"pk-{next(_names)}", serve=serve)


@pytest.mark.parametrize(("sender", "receiver"), [("cuda", "cpu"), ("cpu", "cuda:0")])
def test_host_and_vram_pools_refuse_each_other(
    monkeypatch: pytest.MonkeyPatch, sender: str, receiver: str
) -> None:
    host_backed_vram(monkeypatch)
    with make_node(sender, serve=False) as p, make_node(receiver, serve=True) as d:
        with pytest.raises(LayoutMismatch, match="chunk checksum: the sender's pool hashes with"):
            p.client.connect(d.endpoint)
        assert d.server is not None and d.server.stats.refused == 1


def test_vram_pools_push_verified_with_fold64(monkeypatch: pytest.MonkeyPatch) -> None:
    host_backed_vram(monkeypatch)
    with make_node("cuda", serve=False) as p, make_node("cuda", serve=True) as d:
        keys, slots = fill_store(p, 3, 3, SLOT)
        want = [fold64_reference(chunk_bytes(3, i, SLOT)) for i in range(3)]
        assert [p.store.slot_checksum(s) for s in slots] == want
        link = p.client.connect(d.endpoint)
        res = link.reserve("r", keys, [SLOT] * 3)
        p.store.pool.slot_view(slots[2])[100] ^= 0xFF  # after its checksum was taken
        link.write(res, range(3), slots).wait(5)
        assert d.server is not None
        prog = d.server.wait("r", 5)
        assert prog is not None and prog.filled == {0, 1} and prog.failed == {2}
        assert d.server.stats.checksum_failures == 1
        assert d.store.lookup(keys) == 2
        d.server.release("r")


def test_a_hello_without_a_checksum_is_an_xxh3_senders() -> None:
    """A sender from before the field (its Hello one item shorter) reads as xxh3."""
    hello = proto.Hello(1, "agent", "loopback", FINGERPRINT, b"desc", "fold64")
    old = msgspec.msgpack.encode(["hello", 1, "agent", "loopback", FINGERPRINT, b"desc"])
    decoded = msgspec.msgpack.decode(old, type=proto.Hello)
    assert decoded.checksum == "xxh3" and hello.checksum == "fold64"


def test_a_receiver_that_does_not_check_is_refused_by_the_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receiver from before the field ignores the Hello's checksum (so it
    would take a VRAM sender's fold64 as xxh3 and fail every chunk); its
    HelloAck says xxh3 (the field's default), and the sender refuses."""
    host_backed_vram(monkeypatch)
    real = TransferServer._on_hello

    def unaware(self: TransferServer, identity: bytes, msg: proto.Hello) -> proto.Message:
        return real(self, identity, msgspec.structs.replace(msg, checksum="xxh3"))

    monkeypatch.setattr(TransferServer, "_on_hello", unaware)
    with make_node("cuda", serve=False) as p, make_node("cpu", serve=True) as d:
        with pytest.raises(LayoutMismatch, match="the receiver's pool hashes with xxh3, this"):
            p.client.connect(d.endpoint)
        assert d.server is not None and d.server.stats.refused == 0  # it did not see it


def test_a_hello_ack_without_a_checksum_is_an_xxh3_receivers() -> None:
    old = msgspec.msgpack.encode(["hello_ack", 1, "agent", "loopback", FINGERPRINT, b"d", 64, 8])
    assert msgspec.msgpack.decode(old, type=proto.HelloAck).checksum == "xxh3"
