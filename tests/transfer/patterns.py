"""Deterministic chunk contents shared by the tests and their peer process."""

from __future__ import annotations

import numpy as np

FINGERPRINT = "test-fingerprint-0001"


def chunk_bytes(seed: int, index: int, nbytes: int) -> bytes:
    """Pseudo-random bytes for chunk ``index`` of a request seeded ``seed``."""
    return np.random.default_rng([seed, index]).bytes(nbytes)


def chunk_key(seed: int, index: int) -> bytes:
    return seed.to_bytes(8, "little") + index.to_bytes(8, "little")
