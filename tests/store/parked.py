"""A tier's disk reads of one key, parked until the test lets them go."""

from __future__ import annotations

import threading

import pytest

from fabric.store.tier import TieredStore


class ParkedReads:
    """The tier's disk reads of ``key`` parked until ``gate`` opens."""

    def __init__(self, tier: TieredStore, monkeypatch: pytest.MonkeyPatch, key: bytes) -> None:
        assert tier.disk is not None
        self.real, self.key = tier.disk.read_into, key
        self.parked, self.gate = threading.Event(), threading.Event()
        monkeypatch.setattr(tier.disk, "read_into", self)

    def __call__(self, key: bytes, out: object) -> int | None:
        if key == self.key:
            self.parked.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return self.real(key, out)
