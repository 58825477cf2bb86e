"""Injected faults reach the real transfer path, and the receiver notices each one."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import pytest

from fabric.errors import ConfigError, ReservationRefused
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.store import ChunkStore, SlotState, StoreConfig
from fabric.transfer import RequestProgress, TransferConfig, TransferNode
from fabric.transfer.faults import FaultConfig, FaultInjector
from fabric.transfer.nixl_plane import nixl_available

from .patterns import FINGERPRINT, fill_store

SLOT = 64 << 10
_names = itertools.count()
TRANSPORTS = [
    "loopback",
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl")),
]

Pair = Callable[..., tuple[TransferNode, TransferNode]]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """``pair(transport, send=FaultConfig(...), receive=FaultConfig(...))``."""
    made: list[TransferNode] = []

    def make(
        transport: str,
        send: FaultConfig | None = None,
        receive: FaultConfig | None = None,
        sender_slots: int = 16,
    ) -> tuple[TransferNode, TransferNode]:
        nodes = []
        for faults, serve, slots in ((send, False, sender_slots), (receive, True, 8)):
            store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=slots, quarantine_ms=50))
            config = TransferConfig(
                transport=transport,  # type: ignore[arg-type]
                poll_interval_ms=0.5,
                ucx_net_devices="lo",
                faults=faults or FaultConfig(),
            )
            name = f"fault-{transport}-{next(_names)}"
            nodes.append(TransferNode(store, config, FINGERPRINT, name=name, serve=serve))
            made.append(nodes[-1])
        return nodes[0], nodes[1]

    yield make
    for node in reversed(made):
        node.close()


def fill(node: TransferNode, seed: int, n: int) -> tuple[list[bytes], list[int]]:
    return fill_store(node, seed, n, SLOT)


def settled(node: TransferNode, request_id: str, count: int) -> RequestProgress:
    """The progress once ``count`` chunks are verified or failed (a failure
    finishes a reservation before its other chunks are checked)."""
    assert node.server is not None
    deadline = time.monotonic() + 10
    while True:
        prog = node.server.progress(request_id)
        if prog is not None and len(prog.filled) + len(prog.failed) >= count:
            return prog
        assert time.monotonic() < deadline, prog
        time.sleep(0.005)


def slot_bytes(node: TransferNode, slot: int) -> bytes:
    return bytes(node.store.pool.memoryview(slot, SLOT))


# --------------------------------------------------------------- config


def test_faults_are_off_by_default() -> None:
    assert not TransferConfig().faults.enabled
    assert not FaultConfig(delay_ms=0).enabled and FaultConfig(delay_ms=5).enabled
    assert not FaultConfig(delay=0.0, delay_ms=5).enabled
    store = ChunkStore(StoreConfig(slot_bytes=SLOT, num_slots=1))
    config = TransferConfig(transport="loopback")
    with TransferNode(store, config, FINGERPRINT, name=f"off-{next(_names)}") as node:
        assert node.client.faults is None and node.server is not None
        assert node.server.faults is None


def test_faults_from_the_connector_config() -> None:
    config = ConnectorConfig.from_extra({"faults": {"corrupt": 1.0, "seed": 3}})
    assert config.faults == FaultConfig(corrupt=1.0, seed=3)
    with pytest.raises(ConfigError, match="faults: unknown key"):
        ConnectorConfig.from_extra({"faults": {"corupt": 1.0}})
    with pytest.raises(ConfigError, match=r"faults\.refuse: 2"):
        ConnectorConfig.from_extra({"faults": {"refuse": 2}})
    with pytest.raises(ConfigError, match="faults: expected a mapping"):
        ConnectorConfig.from_extra({"faults": "corrupt"})
    with pytest.raises(ConfigError, match="delay_ms"):
        FaultConfig(delay_ms="5")  # type: ignore[arg-type]


def test_rolls_are_seeded_and_follow_the_probability() -> None:
    def rolls(seed: int) -> list[bool]:
        injector = FaultInjector(FaultConfig(corrupt=0.5, seed=seed), "send")
        return [injector.roll("corrupt") for _ in range(400)]

    assert rolls(1) == rolls(1) != rolls(2)
    assert 140 < sum(rolls(1)) < 260
    injector = FaultInjector(FaultConfig(corrupt=0.5, seed=1), "send")
    fired = sum(injector.roll("corrupt") for _ in range(400))
    assert injector.injected["corrupt"] == fired


# --------------------------------------------------------------- faults on the wire


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_transfer_is_detected_and_quarantined(pair: Pair, transport: str) -> None:
    sender, receiver = pair(transport, send=FaultConfig(corrupt=1.0))
    keys, slots = fill(sender, 1, 3)
    before = [slot_bytes(sender, s) for s in slots]
    res = sender.client.connect(receiver.endpoint).push("r1", keys, slots, timeout=10)
    assert receiver.server is not None
    prog = settled(receiver, "r1", 3)
    assert prog.failed == {0, 1, 2} and not prog.filled
    assert receiver.server.stats.checksum_failures == 3
    assert receiver.store.lookup(keys) == 0  # nothing marked present
    assert {receiver.store.slot_state(s) for s in res.slots} == {SlotState.QUARANTINED}
    # the sender's own chunks are untouched and its scratch slots are free again
    assert [slot_bytes(sender, s) for s in slots] == before
    assert sender.store.reserved_count() == 0
    assert sender.client.faults is not None
    assert sender.client.faults.injected["corrupt"] == 3
    receiver.server.release("r1")


def test_corrupt_flips_the_checksum_when_no_scratch_slot_is_free(pair: Pair) -> None:
    sender, receiver = pair("loopback", send=FaultConfig(corrupt=1.0), sender_slots=2)
    keys, slots = fill(sender, 2, 2)  # the sender's pool is full
    sender.client.connect(receiver.endpoint).push("r2", keys, slots, timeout=5)
    assert receiver.server is not None
    prog = settled(receiver, "r2", 2)
    assert prog.failed == {0, 1}
    assert receiver.store.lookup(keys) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dropped_write_notifies_and_fails_verification(pair: Pair, transport: str) -> None:
    sender, receiver = pair(transport, send=FaultConfig(drop_write=1.0))
    keys, slots = fill(sender, 3, 2)
    res = sender.client.connect(receiver.endpoint).push("r3", keys, slots, timeout=10)
    assert receiver.server is not None
    prog = settled(receiver, "r3", 2)
    assert prog.failed == {0, 1}
    assert receiver.store.lookup(keys) == 0
    assert all(slot_bytes(receiver, s) == bytes(SLOT) for s in res.slots)  # no byte landed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dropped_notification_times_out_and_expires(pair: Pair, transport: str) -> None:
    sender, receiver = pair(transport, send=FaultConfig(drop_notify=1.0))
    keys, slots = fill(sender, 4, 2)
    link = sender.client.connect(receiver.endpoint)
    res = link.reserve("r4", keys, [SLOT] * 2, lease_ms=300)
    link.write(res, range(2), slots).wait(10)
    # the bytes are there, but without a notification nothing vouches for them
    deadline = time.monotonic() + 5
    while slot_bytes(receiver, res.slots[1]) != slot_bytes(sender, slots[1]):
        assert time.monotonic() < deadline, "bytes did not land"
        time.sleep(0.01)
    assert receiver.server is not None
    prog = receiver.server.wait("r4", 2)
    assert prog is not None and prog.expired and not prog.landed and not prog.filled
    assert receiver.store.lookup(keys) == 0
    assert receiver.server.stats.expired == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_delayed_transfer_arrives_late_but_whole(pair: Pair, transport: str) -> None:
    sender, receiver = pair(transport, send=FaultConfig(delay_ms=300))
    keys, slots = fill(sender, 5, 2)
    started = time.monotonic()
    sender.client.connect(receiver.endpoint).push("r5", keys, slots, timeout=10)
    assert receiver.server is not None
    prog = receiver.server.wait("r5", 10)
    assert time.monotonic() - started >= 0.3
    assert prog is not None and prog.complete
    assert receiver.store.lookup(keys) == 2


@pytest.mark.parametrize("transport", ["loopback", "tcp"])
def test_refused_reservations(pair: Pair, transport: str) -> None:
    sender, receiver = pair(transport, receive=FaultConfig(refuse=1.0))
    keys, slots = fill(sender, 6, 1)
    link = sender.client.connect(receiver.endpoint)
    with pytest.raises(ReservationRefused, match="fault_injected"):
        link.push("r6", keys, slots, timeout=5)
    assert receiver.server is not None
    assert receiver.server.stats.faults_injected == 1
    assert receiver.store.reserved_count() == 0


def test_partial_probability_mixes_good_and_corrupt_chunks(pair: Pair) -> None:
    sender, receiver = pair("loopback", send=FaultConfig(corrupt=0.5, seed=1))
    keys, slots = fill(sender, 8, 8)
    sender.client.connect(receiver.endpoint).push("r8", keys, slots, timeout=5)
    assert receiver.server is not None
    prog = settled(receiver, "r8", 8)
    assert sender.client.faults is not None
    corrupted = sender.client.faults.injected["corrupt"]
    assert 0 < corrupted < 8 and len(prog.failed) == corrupted
    assert len(prog.filled) == 8 - corrupted
