"""StoreConfig validation and argument checks name the offending field."""

from __future__ import annotations

import pytest

from fabric.errors import ConfigError
from fabric.store import ChunkPool, ChunkStore, StoreConfig

from ._helpers import SLOT_BYTES, StoreFactory, key


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"slot_bytes": 0}, "slot_bytes"),
        ({"slot_bytes": 1.5}, "slot_bytes"),
        ({"num_slots": -2}, "num_slots"),
        ({"num_slots": True}, "num_slots"),
        ({"quarantine_ms": -1}, "quarantine_ms"),
        ({"default_lease_ms": 0}, "default_lease_ms"),
        ({"default_lease_ms": "10"}, "default_lease_ms"),
    ],
)
def test_config_error_names_the_field(overrides: dict[str, object], field: str) -> None:
    fields = {"slot_bytes": 64, "num_slots": 2} | overrides
    with pytest.raises(ConfigError, match=f"^{field}:"):
        StoreConfig(**fields)  # type: ignore[arg-type]


def test_config_defaults_and_zero_quarantine() -> None:
    config = StoreConfig(slot_bytes=64, num_slots=2, quarantine_ms=0)
    assert (config.quarantine_ms, config.default_lease_ms) == (0, 10000)


def test_pool_must_match_config() -> None:
    with pytest.raises(ConfigError, match=r"^pool:"):
        ChunkStore(StoreConfig(slot_bytes=64, num_slots=2), ChunkPool(3, 64))


def test_store_uses_the_given_pool() -> None:
    pool = ChunkPool(2, 64)
    assert ChunkStore(StoreConfig(slot_bytes=64, num_slots=2), pool).pool is pool


@pytest.mark.parametrize(
    ("nbytes", "field"),
    [([1, SLOT_BYTES + 1], r"nbytes\[1\]"), ([0, 1], r"nbytes\[0\]"), ([1, 2, 3], "nbytes")],
)
def test_reserve_checks_sizes(make_store: StoreFactory, nbytes: list[int], field: str) -> None:
    store = make_store()
    with pytest.raises(ConfigError, match=f"^{field}:"):
        store.reserve("r", [key(0), key(1)], nbytes)
    assert store.reserved_count() == 0 and store.reservation("r") is None


def test_reserve_checks_lease(make_store: StoreFactory) -> None:
    with pytest.raises(ConfigError, match=r"^lease_ms:"):
        make_store().reserve("r", [key(0)], [1], lease_ms=0)
