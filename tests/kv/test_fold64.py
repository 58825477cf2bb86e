"""fold64, the VRAM pools' chunk checksum: torch ops, the CUDA header and the
plain definition agree bit for bit, and it sees the faults a checksum is for."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fabric.kv.fold64 import fold64, fold64_reference, fold64_tensor

CSRC = Path(__file__).resolve().parents[2] / "fabric" / "kv" / "csrc"
LENGTHS = [0, 1, 7, 8, 9, 15, 16, 63, 64, 65, 1000, 4097]


def _bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + n).randbytes(n)


def _tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


@pytest.mark.parametrize("n", LENGTHS)
def test_torch_matches_the_definition(n: int) -> None:
    data = _bytes(n)
    assert fold64(_tensor(data)) == fold64_reference(data)


def test_high_bits_and_all_ones() -> None:
    for data in (b"\xff" * 64, b"\x80" * 24, bytes(range(256))):
        assert fold64(_tensor(data)) == fold64_reference(data)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_the_cuda_header_matches_torch(tmp_path: Path) -> None:
    """fold64.h's term and finish (what the kernel runs per word and once at
    the end), compiled for the host, against the torch ops."""
    program = tmp_path / "fold64_host.cpp"
    program.write_text(
        """
#include <cstdio>
#include <vector>
#include "fold64.h"
int main() {
  std::vector<unsigned char> d;
  for (int c; (c = std::getchar()) != EOF;) d.push_back(static_cast<unsigned char>(c));
  const int64_t n = static_cast<int64_t>(d.size());
  uint64_t sum = 0;
  for (int64_t i = 0; i * 8 < n; ++i) {
    uint64_t w = 0;
    for (int k = 0; k < 8 && i * 8 + k < n; ++k) w |= uint64_t(d[i * 8 + k]) << (8 * k);
    sum += fabric::fold64_term(w, uint64_t(i));
  }
  std::printf("%llu\\n", static_cast<unsigned long long>(fabric::fold64_finish(sum, n)));
}
"""
    )
    binary = tmp_path / "fold64_host"
    built = subprocess.run(
        ["g++", "-std=c++17", "-O2", f"-I{CSRC}", str(program), "-o", str(binary)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    for n in LENGTHS:
        data = _bytes(n, seed=1)
        out = subprocess.run([str(binary)], input=data, capture_output=True, timeout=60)
        assert int(out.stdout) == fold64(_tensor(data)), n


def test_any_single_byte_change_is_seen() -> None:
    data = bytearray(_bytes(520, seed=2))
    base = fold64_reference(bytes(data))
    for pos in range(0, 520, 13):
        for flip in (1, 0x80):
            data[pos] ^= flip
            assert fold64(_tensor(bytes(data))) != base, (pos, flip)
            data[pos] ^= flip


def test_moved_words_and_lengths_are_seen() -> None:
    data = _bytes(256, seed=3)
    swapped = data[8:16] + data[0:8] + data[16:]
    assert fold64_reference(swapped) != fold64_reference(data)
    # NOTE: the same words one block later (a chunk landed at the wrong offset)
    assert fold64_reference(bytes(8) + data[:-8]) != fold64_reference(data)
    assert fold64_reference(b"") != fold64_reference(bytes(1)) != fold64_reference(bytes(8))


def test_stays_on_the_device_and_refuses_other_dtypes() -> None:
    data = _tensor(_bytes(100))
    out = fold64_tensor(data.view(10, 10))
    assert out.dtype == torch.int64 and out.dim() == 0 and out.device == data.device
    with pytest.raises(ValueError, match="uint8"):
        fold64_tensor(torch.zeros(4, dtype=torch.float16))


@pytest.mark.parametrize("offset", [1, 3, 4])
def test_a_view_that_starts_off_a_word_boundary(offset: int) -> None:
    """A slot of a pool whose slot size is not a multiple of 8 starts off a
    word boundary; its bytes are hashed as bytes, wherever they start."""
    data = _bytes(4000 + offset, seed=4)
    view = _tensor(data)[offset : offset + 4000]  # 4000 bytes: whole words, misaligned
    assert fold64(view) == fold64_reference(data[offset : offset + 4000])
