"""Prefix-chained chunk keys: format, determinism across processes, inputs."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import blake3
import numpy as np
import pytest
import torch

from fabric.errors import ConfigError
from fabric.kv import chunk_keys, num_chunks, num_full_chunks

FP = "730cb95f5aaa2d4b8ab9d873fcd41d95dafeb3b3b4d723357310afc576ef1f55"
TOKENS = list(range(1000, 1600))  # 2 full chunks of 256 and a partial of 88

# NOTE: computed once; if these change, keys no longer match between versions.
GOLDEN = [
    "92f96ac5e0c4b35cc9d0bbaefca82d74",
    "d324581ca85ad39e7ec880f28ce48261",
    "93cd87cc51b20d2e02ae6ce6b918eb0c",
]


def test_golden_keys() -> None:
    assert [k.hex() for k in chunk_keys(TOKENS, 256, FP)] == GOLDEN


def test_first_key_follows_documented_format() -> None:
    tokens = TOKENS[:256]
    payload = bytes(16) + struct.pack("<I", 256) + struct.pack("<256i", *tokens) + FP.encode()
    assert chunk_keys(TOKENS, 256, FP)[0] == blake3.blake3(payload).digest()[:16]


def test_keys_same_in_subprocess_with_other_hash_seed() -> None:
    code = (
        "from fabric.kv import chunk_keys\n"
        f"print(' '.join(k.hex() for k in chunk_keys(list(range(1000, 1600)), 256, {FP!r})))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == GOLDEN


@pytest.mark.parametrize(
    "convert",
    [
        list,
        lambda t: np.asarray(t, dtype=np.int64),
        lambda t: np.asarray(t, dtype=np.int32),
        lambda t: np.asarray(t, dtype=np.uint32),
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
    ],
    ids=["list", "np-int64", "np-int32", "np-uint32", "torch-int64", "torch-int32"],
)
def test_input_types_give_same_keys(convert) -> None:
    assert [k.hex() for k in chunk_keys(convert(TOKENS), 256, FP)] == GOLDEN


def test_partial_chunk_can_be_left_out() -> None:
    assert [k.hex() for k in chunk_keys(TOKENS, 256, FP, include_partial=False)] == GOLDEN[:2]
    assert chunk_keys(TOKENS[:512], 256, FP) == chunk_keys(
        TOKENS[:512], 256, FP, include_partial=False
    )


def test_keys_chain_over_prefixes() -> None:
    other = [*TOKENS[:256], *(t + 1 for t in TOKENS[256:])]
    mine, theirs = chunk_keys(TOKENS, 256, FP), chunk_keys(other, 256, FP)
    assert mine[0] == theirs[0]
    assert mine[1] != theirs[1] and mine[2] != theirs[2]


def test_changing_an_early_token_changes_every_key() -> None:
    other = [TOKENS[0] + 1, *TOKENS[1:]]
    assert not set(chunk_keys(TOKENS, 256, FP)) & set(chunk_keys(other, 256, FP))


def test_partial_tail_key_differs_from_padded() -> None:
    # The length prefix keeps a short tail apart from one padded with zeros.
    short = chunk_keys([1, 2, 3], 4, FP)
    padded = chunk_keys([1, 2, 3, 0], 4, FP)
    assert short != padded


def test_fingerprint_separates_keys() -> None:
    assert chunk_keys(TOKENS, 256, FP)[0] != chunk_keys(TOKENS, 256, FP[:-1] + "0")[0]


def test_empty_and_exact_lengths() -> None:
    assert chunk_keys([], 256, FP) == []
    assert len(chunk_keys(TOKENS[:256], 256, FP)) == 1
    assert all(len(k) == 16 for k in chunk_keys(TOKENS, 7, FP))


@pytest.mark.parametrize(
    ("num_tokens", "full", "with_partial"), [(0, 0, 0), (255, 0, 1), (256, 1, 1), (600, 2, 3)]
)
def test_chunk_counts(num_tokens: int, full: int, with_partial: int) -> None:
    assert num_full_chunks(num_tokens, 256) == full
    assert num_chunks(num_tokens, 256) == with_partial
    assert num_chunks(num_tokens, 256, include_partial=False) == full


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([[1, 2], [3, 4]], "must be 1-D"),
        ([1.5, 2.0], "must be integers"),
        ([2**31], "fit in int32"),
        ([-(2**31) - 1], "fit in int32"),
    ],
)
def test_bad_token_ids(tokens: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_keys(tokens, 256, FP)


def test_bad_chunk_tokens() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens must be > 0"):
        chunk_keys(TOKENS, 0, FP)
