"""Which of a prompt's blocks each chunk holds, and where a load puts them.

A chunk is ``chunk_blocks`` blocks of the prompt (``chunk_tokens /
block_size``); the last chunk of a prompt may hold fewer
(:func:`chunk_block_counts`). A load that starts at prompt block
``first_block`` (the blocks before it are already in the engine: vLLM's own
prefix cache) unpacks only the chunks' blocks from there on, into the
block ids vLLM allocated for them, in prompt order::

    prompt blocks:  | 0 1 2 3 | 4 5 6 7 | 8 9 |     chunk_blocks 4, counts [4, 4, 2]
    first_block 2:       [2 3 | 4 5 6 7 | 8 9]  -> block_ids [a b c d e f g h]
    spans:          0: first 2, targets [a b]
                    1: first 0, targets [c d e f]
                    2: first 0, targets [g h]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSpan:
    """The blocks of chunk ``index`` a load unpacks: the chunk's blocks
    ``first`` on (of ``chunk_blocks`` it holds), into ``targets``."""

    index: int
    first: int
    chunk_blocks: int
    targets: tuple[int, ...]


def chunk_block_counts(num_tokens: int, chunk_tokens: int, block_size: int) -> list[int]:
    """Blocks each chunk of a ``num_tokens`` prompt covers (the last may be short)."""
    counts = []
    for start in range(0, num_tokens, chunk_tokens):
        tokens = min(chunk_tokens, num_tokens - start)
        counts.append(-(-tokens // block_size))
    return counts


def chunk_spans(
    first_block: int, block_ids: Sequence[int], counts: Sequence[int], chunk_blocks: int
) -> list[ChunkSpan]:
    """The spans of a load whose ``block_ids[i]`` receives prompt block
    ``first_block + i``, in chunk order; it stops at the first block past the
    chunks ``counts`` describes (a block id left over is not a chunk's)."""
    spans: list[ChunkSpan] = []
    for offset, block_id in enumerate(block_ids):
        index, pos = divmod(first_block + offset, chunk_blocks)
        if index >= len(counts) or pos >= counts[index]:
            break
        if spans and spans[-1].index == index:
            last = spans[-1]
            spans[-1] = ChunkSpan(index, last.first, last.chunk_blocks, (*last.targets, block_id))
        else:
            spans.append(ChunkSpan(index, pos, counts[index], (block_id,)))
    return spans
