"""Thread-safe connector counters (no vLLM import, for unit tests)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

STRICT_ENV = "FABRIC_STRICT_COUNTERS"
"""Set (to anything but empty), :meth:`FabricCounters.add` raises on a name
that is not a counter; unset, it logs it once and drops it (the tests set it:
a ValueError inside a vLLM hook or a fabric thread would fail the engine)."""

COUNTERS = {
    "chunks_sent": "chunks pushed to decoders",
    "bytes_sent": "bytes pushed to decoders (a chunk's parts written during the forward included)",
    "push_failures": "pushes abandoned (decoder unreachable, refused, timed out)",
    "chunks_loaded": "chunks unpacked into the KV cache",
    "bytes_loaded": "bytes unpacked into the KV cache",
    "chunks_streamed": "pushed chunks unpacked a layer group at a time as the prefiller's "
    "parts landed, verified in the same pass (of chunks_loaded)",
    "streams_redone": "streamed chunks whose bytes did not hash to the prefiller's checksum "
    "as they were unpacked: the slot verified whole and the chunk unpacked again",
    "parts_sent": "layer groups of chunks written to decoders while the forward pass still "
    "computed the later layers (before the chunk's last group)",
    "chunks_offered": "chunks the decoder READ out of this engine's KV cache (direct_reads; "
    "of chunks_sent)",
    "parts_offered": "layer groups of chunks the decoder READ out of this engine's KV cache "
    "while the forward pass still computed the later layers (direct_reads)",
    "pushes_direct": "pushes direct_reads auto sent the direct way (the decoder READs the "
    "chunks out of this engine's KV cache), by the link's measured costs",
    "pushes_staged": "pushes direct_reads auto sent the staged way (packed, then written), by "
    "the link's measured costs or because the decoder does not read",
    "holds_released": "requests whose KV blocks vLLM kept after they finished, for decoders "
    "to read (direct_reads), handed back once their push was over",
    "tokens_loaded": "prompt tokens whose KV arrived over the fabric",
    "loads_ok": "requests whose KV arrived over the fabric",
    "load_failures": "requests whose KV did not arrive: recomputed locally (fallback)",
    "store_hit_chunks": "chunks loaded from this engine's own store instead of computed",
    "store_hit_tokens": "prompt tokens loaded from this engine's own store instead of computed",
    "store_load_failures": "store hits lost before they were loaded: recomputed",
    "chunks_saved": "computed chunks packed into this engine's store for reuse",
    "chunks_packed_layerwise": "computed chunks packed layer group by layer group while the "
    "forward pass ran (layer_groups), only the last group at the step's end",
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
    "lookup_timeouts": "reuse-tier lookups (one per TP rank) and shared-store fetches with no "
    "answer within lookup_deadline_ms: a miss for that request, the prompt is computed",
    "lookup_backoffs": "times the scheduler stopped asking its reuse tier or the shared store "
    "for a while (a hard failure or repeated late answers; the log says why)",
    "claims_expired": "transfers pushed for a request that waited in vLLM's queue longer "
    "than waiting_hold_s: no longer kept alive (their lease then runs out)",
    "loads_ended": "loads given up because their request ended first (aborted while its KV "
    "was on the way): released at once, not a load failure",
    "scheduler_wait_overruns": "lookups and fetches whose ask ran more than 5 ms past the "
    "step's wait (lookup_timeout_ms)",
    "scheduler_wait_overrun_us": "microseconds those asks ran past the step's wait",
    "scheduler_wait_overrun_cpu_us": "microseconds of the scheduler thread's CPU time in "
    "those asks",
    "scheduler_wait_overrun_runq_us": "microseconds the OS kept the scheduler thread waiting to "
    "run in those asks (runnable, not running: the machine was busy)",
    "lookup_waits_skipped": "reuse-tier lookups and shared-store fetches sent without waiting "
    "for their answer in the step, because recent ones rarely came within lookup_timeout_ms",
    "lookups_deferred": "reuse-tier lookups and shared-store fetches not answered within the "
    "step's wait (lookup_timeout_ms): vLLM skipped the request and asked again next step",
}


HISTOGRAMS = {
    "load_seconds": "decoder: from a load's start until the pushed KV is in vLLM's blocks",
    "chunk_write_seconds": "prefiller: from posting one chunk's WRITE until it is done",
    "push_tail_seconds": "prefiller: from a complete push's last chunk handed to its sender "
    "(packed, or hashed, once the forward ended) until its last write landed or the "
    "decoder's last READ of it ended (not the decoder's unpack of that last part)",
    "store_load_seconds": "loading a request's store hit into vLLM's blocks (before the forward)",
    "scheduler_hold_seconds": "per scheduler step: time vLLM's scheduler spent inside fabric's "
    "scheduler-side hooks (lookups, fetches, bookkeeping)",
    "scheduler_wait_seconds": "per scheduler step: the part of scheduler_hold_seconds spent "
    "inside reuse-tier lookups and shared-store fetches (sending, and polling for answers up "
    "to lookup_timeout_ms; what ran past it is counted in scheduler_wait_overruns)",
}
# NOTE: a CPU load of a 4k-token KV-heavy prompt takes ~0.1-1 s; a GPU chunk write ~1 ms.
BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


TABLES_KEY = "tables"
"""``take()``'s entry for table sizes: {source: {table: entries}}."""


_REPORTED: set[str] = set()  # NOTE: unknown names logged once per process
_REPORTED_LOCK = threading.Lock()


class FabricCounters:
    """Thread-safe counters, latency samples and table sizes, drained by ``take()``.

    ``take()`` returns counter name -> int, histogram name -> list of
    seconds observed since the last call, and (under ``TABLES_KEY``, only
    when a size changed since the last call) {source: {table: entries}}: the
    current sizes of per-request tables, set by :meth:`set_tables`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int | list[float]] = {}
        self._tables: dict[str, dict[str, int]] = {}
        self._tables_changed = False

    def set_tables(self, source: str, sizes: Mapping[str, int]) -> None:
        """The current entry counts of ``source``'s per-request tables
        (``source``: one per process or rank, e.g. "scheduler", "worker0";
        table names unique across components, e.g. "scheduler_sending").
        Exported as the gauge ``vllm:fabric_table_entries{table=...}``, summed
        over sources."""
        sizes = {name: int(n) for name, n in sizes.items()}
        with self._lock:
            if self._tables.get(source) != sizes:
                self._tables[source] = sizes
                self._tables_changed = True

    def add(self, **deltas: int) -> None:
        """Add to counters named in :data:`COUNTERS`. Another name is a bug (a
        misspelt counter would never be exported): ValueError under
        ``$FABRIC_STRICT_COUNTERS``, else logged once per name and dropped."""
        unknown = deltas.keys() - COUNTERS.keys()
        if unknown:
            self._unknown(unknown)
            deltas = {name: delta for name, delta in deltas.items() if name in COUNTERS}
        with self._lock:
            for name, delta in deltas.items():
                value = self._counts.get(name, 0)
                assert isinstance(value, int)
                self._counts[name] = value + delta

    def _unknown(self, names: set[str]) -> None:
        if os.environ.get(STRICT_ENV):
            raise ValueError(f"not fabric counters: {', '.join(sorted(names))}")
        with _REPORTED_LOCK:
            new = names - _REPORTED
            _REPORTED.update(new)
        if new:
            logger.error("fabric: not counters, dropped (a bug): %s", ", ".join(sorted(new)))

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            samples = self._counts.setdefault(name, [])
            assert isinstance(samples, list)
            samples.append(seconds)

    def take(self) -> dict[str, Any]:
        with self._lock:
            counts: dict[str, Any] = dict(self._counts)
            self._counts = {}
            if self._tables_changed:
                counts[TABLES_KEY] = {src: dict(t) for src, t in self._tables.items()}
                self._tables_changed = False
        return counts

    def tables(self) -> dict[str, int]:
        """The latest table sizes, summed over sources (table -> entries)."""
        with self._lock:
            return sum_tables(self._tables)


def sum_tables(by_source: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """{source: {table: n}} -> {table: n summed over sources}."""
    out: dict[str, int] = {}
    for sizes in by_source.values():
        for name, n in sizes.items():
            out[name] = out.get(name, 0) + n
    return out
