"""Connector counters, shipped to vLLM's stats logger and Prometheus.

The worker counts into :class:`FabricCounters`; every step vLLM asks for
``get_kv_connector_stats()``, which hands over the counts since the last
call as a :class:`FabricStats`. vLLM aggregates them across workers, logs
them, and feeds them to :class:`FabricPromMetrics`, which exports
``vllm:fabric_<name>_total`` counters, ``vllm:fabric_<name>`` latency
histograms (``*_seconds``) and the gauge ``vllm:fabric_table_entries{table=}``
(per-request table sizes, latest per source, summed over sources) on the
engine's ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from fabric.integrations.vllm.counters import (
    BUCKETS,
    COUNTERS,
    HISTOGRAMS,
    TABLES_KEY,
    sum_tables,
)


@dataclass
class FabricStats(KVConnectorStats):
    """Since the last report: counter name -> int, histogram name -> [seconds],
    and ``TABLES_KEY`` -> {source: {table: entries}} (latest sizes)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name == TABLES_KEY:  # NOTE: sizes, not deltas: the later report wins
                tables = dict(self.data.get(TABLES_KEY, {}))
                tables.update(value)
                self.data[TABLES_KEY] = tables
            elif isinstance(value, list):
                self.data[name] = [*self.data.get(name, []), *value]
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in self.data.items():
            if name == TABLES_KEY:
                for table, n in sorted(sum_tables(value).items()):
                    out[f"table {table}"] = n
            elif isinstance(value, list):
                if value:
                    out[f"{name} (mean of {len(value)})"] = round(sum(value) / len(value), 4)
            else:
                out[name] = value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class FabricPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of ``COUNTERS``, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:fabric_{name}", documentation=doc, labelnames=labelnames
            )
            self._counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self._tables: Any = self._gauge_cls(
            name="vllm:fabric_table_entries",
            documentation="entries in fabric's per-request tables (0 when no request is "
            "in flight; growth means a leak)",
            labelnames=[*labelnames, "table"],
        )
        self._labelvalues = per_engine_labelvalues
        self._sources: dict[int, dict[str, dict[str, int]]] = {}
        self._histograms: dict[str, dict[int, Any]] = {}
        for name, doc in HISTOGRAMS.items():
            histogram = self._histogram_cls(  # type: ignore[call-arg]
                name=f"vllm:fabric_{name}",
                documentation=doc,
                labelnames=labelnames,
                buckets=list(BUCKETS),
            )
            self._histograms[name] = {
                idx: histogram.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name == TABLES_KEY:
                self._observe_tables(value, engine_idx)
                continue
            if isinstance(value, list):
                per_engine = self._histograms.get(name)
                for seconds in value if per_engine else ():
                    per_engine[engine_idx].observe(seconds)  # type: ignore[index]
                continue
            counter = self._counters.get(name)
            if counter and value:
                counter[engine_idx].inc(value)

    def _observe_tables(self, by_source: dict[str, dict[str, int]], engine_idx: int) -> None:
        sources = self._sources.setdefault(engine_idx, {})
        sources.update(by_source)
        values = self._labelvalues.get(engine_idx, [])
        for table, n in sum_tables(sources).items():
            self._tables.labels(*values, table).set(n)
