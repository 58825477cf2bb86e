"""Thread-safe connector counters (no vLLM import, for unit tests)."""

from __future__ import annotations

import threading

COUNTERS = {
    "chunks_sent": "chunks pushed to decoders",
    "bytes_sent": "bytes pushed to decoders",
    "push_failures": "pushes abandoned (decoder unreachable, refused, timed out)",
    "chunks_loaded": "chunks unpacked into the KV cache",
    "bytes_loaded": "bytes unpacked into the KV cache",
    "tokens_loaded": "prompt tokens whose KV arrived over the fabric",
    "loads_ok": "requests whose KV arrived over the fabric",
    "load_failures": "requests whose KV did not arrive: recomputed locally (fallback)",
    "store_hit_chunks": "chunks loaded from this engine's own store instead of computed",
    "store_hit_tokens": "prompt tokens loaded from this engine's own store instead of computed",
    "store_load_failures": "store hits lost before they were loaded: recomputed",
    "chunks_saved": "computed chunks packed into this engine's store for reuse",
    "bytes_saved": "bytes packed into this engine's store for reuse",
    "disk_hit_chunks": "chunks read back from the disk tier (checksum verified)",
    "disk_corrupt_chunks": "disk tier files found corrupt or truncated: deleted, not loaded",
    "disk_writes": "chunks written to the disk tier",
    "disk_write_failures": "chunk writes to the disk tier that failed",
    "disk_evictions": "chunk files evicted from the disk tier by its byte budget",
    "shared_store_saved_chunks": "computed chunks written to the shared store (it lacked them)",
    "shared_store_saved_bytes": "bytes written to the shared store",
    "shared_store_loaded_chunks": "chunks fetched from the shared store and loaded",
    "shared_store_loaded_tokens": "prompt tokens loaded through a shared-store fetch",
    "shared_store_failures": "shared store unreachable or refusing; a push to it or load failed",
    "bypassed_requests": "requests fabric cannot key (prompt embeddings, unreadable LoRA "
    "adapter, multimodal item without identifier): no lookup, save or load",
    "refused_transfers": "pushed KV refused by the decoder: not this prompt's keys, chunk "
    "size or layout; recomputed",
    "corrupt_chunks": "chunks whose checksum failed when they were used: recomputed",
    "thread_errors": "exceptions caught in a fabric thread (load, pack, push); the "
    "request(s) it served recompute, the thread keeps serving",
}


HISTOGRAMS = {
    "load_seconds": "decoder: from a load's start until the pushed KV is in vLLM's blocks",
    "chunk_write_seconds": "prefiller: from posting one chunk's WRITE until it is done",
    "store_load_seconds": "loading a request's store hit into vLLM's blocks (before the forward)",
}
# NOTE: a CPU load of a 4k-token KV-heavy prompt takes ~0.1-1 s; a GPU chunk write ~1 ms.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class FabricCounters:
    """Thread-safe counters and latency samples, drained by ``take()``.

    ``take()`` returns counter name -> int, and histogram name -> list of
    seconds observed since the last call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int | list[float]] = {}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                value = self._counts.get(name, 0)
                assert isinstance(value, int)
                self._counts[name] = value + delta

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            samples = self._counts.setdefault(name, [])
            assert isinstance(samples, list)
            samples.append(seconds)

    def take(self) -> dict[str, int | list[float]]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts
