"""PushSender bookkeeping under failures: every slot ref released exactly once."""

from __future__ import annotations

import time

from fabric.integrations.vllm.counters import FabricCounters
from fabric.integrations.vllm.sender import PushJob, PushSender
from fabric.store import ChunkStore, StoreConfig


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
    sender._jobs["r"] = job
    sender._progress()
    assert "r" not in sender._jobs and counters.take()["thread_errors"] == 1
    assert store.acquire([k1]) == [s1]  # the other holder's ref survived: k1 still held
    store.release_slots([s1, s1])
    assert store.stats().reserved == 0
