"""Chunk spans: which blocks of which chunk a load unpacks, and where."""

from __future__ import annotations

import itertools

from fabric.kv.spans import ChunkSpan, chunk_block_counts, chunk_spans


def test_the_docstring_example() -> None:
    spans = chunk_spans(2, list("abcdefgh"), [4, 4, 2], 4)  # type: ignore[arg-type]
    assert spans == [
        ChunkSpan(0, 2, 4, ("a", "b")),  # type: ignore[arg-type]
        ChunkSpan(1, 0, 4, ("c", "d", "e", "f")),  # type: ignore[arg-type]
        ChunkSpan(2, 0, 2, ("g", "h")),  # type: ignore[arg-type]
    ]


def test_block_ids_past_the_chunks_are_not_a_chunks() -> None:
    counts = chunk_block_counts(150, 64, 16)  # [4, 4, 2]: the last chunk holds 22 tokens
    spans = chunk_spans(0, list(range(100, 112)), counts, 4)
    assert [s.index for s in spans] == [0, 1, 2]
    assert spans[-1].targets == (108, 109)  # 110 and 111 are the decode's blocks


def test_every_block_goes_once_to_its_place() -> None:
    """Against the arithmetic the loader and the worker each wrote before:
    block ``first_block + i`` of the prompt lands in ``block_ids[i]``."""
    for chunk_blocks, num_blocks, first_block in itertools.product((1, 2, 4), (1, 5, 9), range(9)):
        counts = [chunk_blocks] * (num_blocks // chunk_blocks)
        if num_blocks % chunk_blocks:
            counts.append(num_blocks % chunk_blocks)
        block_ids = list(range(1000, 1000 + max(num_blocks - first_block, 0) + 3))
        placed = {
            (span.index, span.first + k): target
            for span in chunk_spans(first_block, block_ids, counts, chunk_blocks)
            for k, target in enumerate(span.targets)
        }
        expected = {
            divmod(first_block + i, chunk_blocks): block_ids[i]
            for i in range(max(num_blocks - first_block, 0))
        }
        assert placed == expected, (chunk_blocks, num_blocks, first_block)
