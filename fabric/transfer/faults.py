"""Fault injection: dropped, delayed, corrupted and refused transfers.

Off by default; a test (or an e2e run, through ``kv_connector_extra_config``
``{"faults": {"corrupt": 1.0}}``) switches faults on per engine to check
that every failure is detected and recovered from. Each fault fires with its
probability, drawn from a RNG seeded by ``seed``, so a run is repeatable:

    fault         side      what happens                       what must notice
    -----------   --------  ---------------------------------  --------------------------
    drop_write    sender    notification sent, bytes not       receiver: checksum mismatch
                            written (the slot keeps old bytes)
    drop_notify   sender    bytes written, no notification     receiver: wait times out,
                                                               lease expires
    delay         sender    write posted ``delay_ms`` late     receiver waits longer
    corrupt       sender    one byte flipped in a scratch      receiver: checksum mismatch,
                            copy of a chunk (never in the      slot quarantined
                            sender's store); with no scratch
                            slot free, the checksum is flipped
    refuse        receiver  Reserve answered Refused           sender: ReservationRefused
                            ``fault_injected``

Sender faults roll once per write (``corrupt`` once per chunk); ``refuse``
once per Reserve. :attr:`FaultInjector.injected` counts what fired.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from fabric.errors import CapacityError
from fabric.settings import Settings

if TYPE_CHECKING:
    from fabric.store import ChunkStore
    from fabric.transfer.dataplane import Segment

WriteMode = Literal["normal", "drop_write", "drop_notify"]
_PROBABILITIES = ("drop_write", "drop_notify", "delay", "corrupt", "refuse")


Probability = Annotated[float, Field(strict=True)]


class FaultConfig(Settings):
    """Probabilities (0..1) of each fault; all zero (the default) is off.

    ``delay_ms``: how long a delayed write waits; ``delay`` is the
    probability a write is delayed once ``delay_ms`` is set (1 = every
    write). ``seed`` seeds the RNG of each side.
    """

    SECTION: ClassVar[str] = "faults"

    drop_write: Probability = 0.0
    drop_notify: Probability = 0.0
    delay: Probability = 1.0
    delay_ms: Annotated[float, Field(strict=True, ge=0, le=600_000)] = 0.0
    corrupt: Probability = 0.0
    refuse: Probability = 0.0
    seed: Annotated[int, Field(strict=True)] = 0

    @field_validator(*_PROBABILITIES)
    @classmethod
    def _probability(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{value:g} is not in [0, 1]")
        return value

    @property
    def enabled(self) -> bool:
        """Whether any fault can fire."""
        drops = self.drop_write or self.drop_notify or self.corrupt or self.refuse
        return bool(drops or (self.delay and self.delay_ms))


class FaultInjector:
    """One side's faults: rolls the dice and applies sender faults to a write.

    ``stream`` names the side (``"send"``/``"receive"``) so the two sides of
    one process draw from separate, repeatable sequences. Thread-safe.
    """

    def __init__(self, config: FaultConfig, stream: str) -> None:
        self.config = config
        self._rng = random.Random(f"fabric-faults:{config.seed}:{stream}")
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()

    def roll(self, fault: str) -> bool:
        """True (and counted) with the probability of ``fault``."""
        probability = getattr(self.config, fault)
        if fault == "delay" and not self.config.delay_ms:
            return False
        with self._lock:
            fired = probability > 0 and self._rng.random() < probability
            if fired:
                self.injected[fault] += 1
        return fired

    def delay(self) -> None:
        """Sleep ``delay_ms`` when the delay fault fires."""
        if self.roll("delay"):
            time.sleep(self.config.delay_ms / 1000)

    def write_mode(self) -> WriteMode:
        """How this write goes out: whole, without its bytes, or without its notification."""
        if self.roll("drop_write"):
            return "drop_write"
        if self.roll("drop_notify"):
            return "drop_notify"
        return "normal"

    def corrupt(
        self, store: ChunkStore, segments: Sequence[Segment], checksums: list[int]
    ) -> tuple[list[Segment], list[int]]:
        """Corrupt some chunks of a write (one segment per chunk).

        A corrupted chunk is copied into a scratch slot of ``store`` with one
        byte flipped, and its segment re-pointed there; the sender's own
        chunk is untouched. Returns the new segments and the scratch slots
        (free them with :meth:`release` once the write finished). Without a
        free scratch slot the chunk's checksum is flipped in ``checksums``.
        """
        out, scratch = list(segments), []
        for i, (local, remote, nbytes) in enumerate(segments):
            if not self.roll("corrupt"):
                continue
            try:
                slot = store.allocate(b"fabric-fault:" + uuid.uuid4().bytes)
            except CapacityError:
                checksums[i] ^= 1
                continue
            scratch.append(slot)
            buffer = store.pool.buffer
            copy = buffer.narrow(0, store.pool.slot_offset(slot), nbytes)
            copy.copy_(buffer.narrow(0, local, nbytes))
            with self._lock:
                at = self._rng.randrange(nbytes)
            copy[at] ^= 0xFF
            out[i] = (store.pool.slot_offset(slot), remote, nbytes)
        return out, scratch

    @staticmethod
    def release(store: ChunkStore, scratch: Sequence[int]) -> None:
        """Free the scratch slots of a finished write."""
        for slot in scratch:
            store.abort(slot)
