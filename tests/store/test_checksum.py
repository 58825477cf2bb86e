"""checksum(): xxh3-64 over any zero-copy view of the same bytes, GIL released."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

from fabric.store import checksum

DATA = bytes(range(256)) * 16


@pytest.mark.parametrize(
    "view",
    [
        lambda: DATA,
        lambda: bytearray(DATA),
        lambda: memoryview(DATA),
        lambda: np.frombuffer(DATA, dtype=np.uint8),
        lambda: torch.frombuffer(bytearray(DATA), dtype=torch.uint8),
        lambda: torch.frombuffer(bytearray(DATA), dtype=torch.float32),
        lambda: torch.frombuffer(bytearray(DATA), dtype=torch.bfloat16).view(16, -1),
    ],
    ids=["bytes", "bytearray", "memoryview", "numpy", "torch-u8", "torch-f32", "torch-bf16-2d"],
)
def test_checksum_is_xxh3_64_of_the_bytes(view: object) -> None:
    assert checksum(view()) == xxhash.xxh3_64_intdigest(DATA)  # type: ignore[operator]


def test_checksum_of_a_slice_sees_only_the_slice() -> None:
    tensor = torch.frombuffer(bytearray(DATA), dtype=torch.uint8)
    assert checksum(tensor[100:200]) == xxhash.xxh3_64_intdigest(DATA[100:200])


def test_non_contiguous_is_refused() -> None:
    array = np.frombuffer(DATA, dtype=np.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        checksum(array[::2])
    with pytest.raises(ValueError, match="contiguous"):
        checksum(torch.from_numpy(array.copy())[::2])


def test_checksum_releases_the_gil() -> None:
    """Another thread keeps running while a large buffer is hashed."""
    # NOTE: np.zeros maps the zero page lazily: 1 GiB to hash (~50 ms) that
    # costs no resident memory.
    buf = np.zeros(1 << 30, dtype=np.uint8)
    # NOTE: a few tries, so a busy 2-core CI box does not make this flaky.
    results = [_longest_stall_while_hashing(buf) for _ in range(3)]
    assert any(stall < hash_s / 2 for hash_s, stall in results), results


def _longest_stall_while_hashing(buf: np.ndarray) -> tuple[float, float]:
    """(seconds the hash took, longest gap a spinning thread saw meanwhile)."""
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.01)
    start = time.perf_counter()
    checksum(buf)
    end = time.perf_counter()
    stop.set()
    thread.join()
    inside = [t for t in stamps if start <= t <= end]
    if not inside:
        return end - start, end - start
    # NOTE: the gap after the last stamp is left out: it is the hashing thread
    # waiting up to one switch interval (5 ms) to take the GIL back.
    marks = [start, *inside]
    return end - start, max(b - a for a, b in itertools.pairwise(marks))
