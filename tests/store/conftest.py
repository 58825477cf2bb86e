"""Fixtures for the chunk store tests: a fake clock and small stores."""

from __future__ import annotations

import pytest

from fabric.store import ChunkStore, StoreConfig

from ._helpers import SLOT_BYTES, FakeClock, StoreFactory


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_store(clock: FakeClock) -> StoreFactory:
    """Build a store on the fake clock; keyword overrides go to StoreConfig."""

    def make(num_slots: int = 4, **overrides: int) -> ChunkStore:
        fields = {"slot_bytes": SLOT_BYTES, "num_slots": num_slots} | overrides
        return ChunkStore(StoreConfig(**fields), clock=clock)

    return make


@pytest.fixture
def store(make_store: StoreFactory) -> ChunkStore:
    return make_store()
