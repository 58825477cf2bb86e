"""Connector counters, shipped to vLLM's stats logger and Prometheus.

The worker counts into :class:`FabricCounters`; every step vLLM asks for
``get_kv_connector_stats()``, which hands over the counts since the last
call as a :class:`FabricStats`. vLLM aggregates them across workers, logs
them, and feeds them to :class:`FabricPromMetrics`, which exports
``vllm:fabric_<name>_total`` counters and ``vllm:fabric_<name>`` latency
histograms (``*_seconds``) on the engine's ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from fabric.integrations.vllm.counters import BUCKETS, COUNTERS, HISTOGRAMS


@dataclass
class FabricStats(KVConnectorStats):
    """Since the last report: counter name -> int, histogram name -> [seconds]."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, list):
                self.data[name] = [*self.data.get(name, []), *value]
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in self.data.items():
            if isinstance(value, list):
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
            if isinstance(value, list):
                per_engine = self._histograms.get(name)
                for seconds in value if per_engine else ():
                    per_engine[engine_idx].observe(seconds)  # type: ignore[index]
                continue
            counter = self._counters.get(name)
            if counter and value:
                counter[engine_idx].inc(value)
