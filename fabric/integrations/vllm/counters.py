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
}


class FabricCounters:
    """Thread-safe counters, drained by ``take()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] = self._counts.get(name, 0) + delta

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts
