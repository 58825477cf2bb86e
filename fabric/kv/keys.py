"""Deterministic, prefix-chained chunk keys.

A prompt's tokens are cut into chunks of ``chunk_tokens`` tokens (the last one
may be partial). Chunk ``i``'s key commits to every token before it, so two
prompts share key ``i`` exactly when they share their first chunks::

    key_{-1} = 16 zero bytes               (or the identity's root, below)
    key_i    = blake3( key_{i-1}
                     || len(tokens_i)  as uint32 LE
                     || tokens_i       as int32 LE each
                     || fingerprint    as UTF-8
                     || extra_i )[:16]  (b"" unless multimodal items overlap)

The layout fingerprint (see :meth:`fabric.kv.layout.KVLayout.fingerprint`)
keeps keys of different models, weights, dtypes or TP ranks apart; the
request's :class:`~fabric.kv.identity.KeyIdentity` (LoRA adapter,
``cache_salt``, multimodal items) sets the root and ``extra_i``. Keys are the
same in every process, host and Python version (no ``hash()``, no pickling).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import blake3
import numpy as np

from fabric.errors import ConfigError
from fabric.kv.identity import BASE, KeyIdentity

if TYPE_CHECKING:
    import torch

    TokenIds = Sequence[int] | np.ndarray | torch.Tensor

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def num_full_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """Number of complete chunks in ``num_tokens`` tokens."""
    _check_chunk_tokens(chunk_tokens)
    return num_tokens // chunk_tokens


def num_chunks(num_tokens: int, chunk_tokens: int, *, include_partial: bool = True) -> int:
    """Number of chunks in ``num_tokens`` tokens, counting a partial tail if asked."""
    full = num_full_chunks(num_tokens, chunk_tokens)
    return full + int(include_partial and num_tokens % chunk_tokens != 0)


def chunk_keys(
    token_ids: TokenIds,
    chunk_tokens: int,
    fingerprint: str,
    *,
    include_partial: bool = True,
    identity: KeyIdentity = BASE,
) -> list[bytes]:
    """16-byte prefix-chained keys of the chunks of ``token_ids``.

    ``token_ids`` is a 1-D list, numpy array or torch tensor of ints that fit
    in int32. With ``include_partial=False`` a trailing partial chunk gets no
    key (it cannot be shared until it is complete). ``identity``: what else
    the request's KV depends on (see :mod:`fabric.kv.identity`).
    """
    tokens = _as_int32_le(token_ids)
    count = num_chunks(len(tokens), chunk_tokens, include_partial=include_partial)
    suffix = fingerprint.encode("utf-8")
    keys: list[bytes] = []
    prev = identity.root(ROOT_KEY)
    for i in range(count):
        part = tokens[i * chunk_tokens : (i + 1) * chunk_tokens]
        extra = identity.chunk_extra(i, chunk_tokens) if identity.mm else b""
        prev = chain_key(prev, part, suffix + extra)
        keys.append(prev)
    return keys


def chain_key(prev: bytes, tokens: np.ndarray, suffix: bytes) -> bytes:
    """One link of the chain: the key of ``tokens`` (int32 LE) following
    ``prev``; ``suffix`` is the fingerprint and the chunk's extra bytes."""
    hasher = blake3.blake3(prev)
    hasher.update(struct.pack("<I", len(tokens)))
    hasher.update(tokens.tobytes())
    hasher.update(suffix)
    return hasher.digest(KEY_BYTES)


def _as_int32_le(token_ids: TokenIds) -> np.ndarray:
    """``token_ids`` as a 1-D little-endian int32 array, range-checked."""
    if hasattr(token_ids, "detach"):  # a torch tensor, without importing torch
        token_ids = token_ids.detach().cpu().numpy()
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype="<i4")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got {array.dtype}")
    if array.min() < _INT32_MIN or array.max() > _INT32_MAX:
        raise ValueError("token_ids must fit in int32")
    return array.astype("<i4", copy=False)


def _check_chunk_tokens(chunk_tokens: int) -> None:
    if chunk_tokens <= 0:
        raise ConfigError(f"chunk_tokens must be > 0, got {chunk_tokens}")
