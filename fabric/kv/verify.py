"""Verify a chunk while it is copied: one pass over its bytes, not two.

The chunk's source bytes are walked in pieces of :data:`PIECE_BYTES`. Each
piece is hashed (streaming xxh3-64: the digest equals the one-shot one the
store keeps), then every copy that ends inside what has been hashed so far
is made, reading bytes still in cache::

    src  |<-- piece 0 -->|<-- piece 1 -->|<-- piece 2 -->| ... |<- nbytes
         hash, copy the  hash, copy the  hash, ...              bytes no copy
         copies that     copies that                            reads are
         end in it       end in it                              hashed too

Copies cut at piece boundaries (:func:`split_at_pieces`) each read one
piece; copies left whole are made once their last byte is hashed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

__all__ = ["PIECE_BYTES", "hash_range_while_copying", "hash_while_copying", "split_at_pieces"]

PIECE_BYTES = 512 << 10
"""Bytes hashed before the copies that read them: small enough to still be
in a core's L2 cache when the copy reads them, large enough that the Python
loop around each piece costs little."""


def split_at_pieces(
    offsets: np.ndarray, dst: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut copies (source offset, destination address, nbytes), ascending by
    offset, where they cross a multiple of :data:`PIECE_BYTES`."""
    ends = offsets + lengths
    first = offsets // PIECE_BYTES
    counts = (ends - 1) // PIECE_BYTES - first + 1
    which = np.repeat(np.arange(len(offsets)), counts)
    piece = first[which] + np.arange(len(which)) - np.repeat(np.cumsum(counts) - counts, counts)
    lo = np.maximum(offsets[which], piece * PIECE_BYTES)
    hi = np.minimum(ends[which], (piece + 1) * PIECE_BYTES)
    return lo, np.ascontiguousarray(dst[which] + (lo - offsets[which])), hi - lo


def hash_while_copying(
    data: memoryview, nbytes: int, ends: np.ndarray, copy: Callable[[int, int], None]
) -> int:
    """The xxh3-64 of ``data[:nbytes]``; copies ``a .. b - 1`` (``copy(a, b)``)
    are made as soon as their ``ends`` (ascending, at most ``nbytes``) are hashed."""
    hasher = xxhash.xxh3_64()
    hash_range_while_copying(data, hasher, 0, nbytes, ends, copy)
    return hasher.intdigest()


def hash_range_while_copying(
    data: memoryview,
    hasher: xxhash.xxh3_64,
    start: int,
    stop: int,
    ends: np.ndarray,
    copy: Callable[[int, int], None],
) -> None:
    """Feed ``data[start:stop]`` to ``hasher`` piece by piece (pieces on
    multiples of :data:`PIECE_BYTES`, as :func:`split_at_pieces` cuts the
    copies); copies ``a .. b - 1`` are made as soon as their ``ends``
    (ascending, in ``start .. stop``) are hashed. A chunk hashed so in
    consecutive ranges gets the digest of hashing it whole."""
    if stop <= start:
        return
    first = start // PIECE_BYTES + 1
    last = -(-stop // PIECE_BYTES)
    tops = np.minimum(np.arange(first, last + 1, dtype=np.int64) * PIECE_BYTES, stop)
    bounds = np.searchsorted(ends, tops, side="right").tolist()
    done, at = 0, start
    for top, upto in zip(tops.tolist(), bounds, strict=True):
        hasher.update(data[at:top])
        at = top
        if upto > done:
            copy(done, upto)
            done = upto
