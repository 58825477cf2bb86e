"""KV cache layouts, chunk keys, and packing blocks into chunks.

layout  KVLayout / LayoutKind: an engine's paged-cache geometry, its
        fingerprint, and the chunk byte format
keys    chunk_keys: prefix-chained 16-byte chunk keys
pack    pack / unpack: blocks <-> contiguous chunk bytes at memcpy speed
"""

from __future__ import annotations

from fabric.kv.keys import chunk_keys, num_chunks, num_full_chunks
from fabric.kv.layout import KVLayout, LayoutKind
from fabric.kv.pack import backend, pack, pack_checksummed, unpack

__all__ = [
    "KVLayout",
    "LayoutKind",
    "backend",
    "chunk_keys",
    "num_chunks",
    "num_full_chunks",
    "pack",
    "pack_checksummed",
    "unpack",
]
