"""Connector counters, shipped to vLLM's stats logger and Prometheus.

The worker counts into :class:`FabricCounters`; every step vLLM asks for
``get_kv_connector_stats()``, which hands over the counts since the last
call as a :class:`FabricStats`. vLLM aggregates them across workers, logs
them, and feeds them to :class:`FabricPromMetrics`, which exports
``vllm:fabric_<name>_total`` counters on the engine's ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from fabric.integrations.vllm.counters import COUNTERS


@dataclass
class FabricStats(KVConnectorStats):
    """Counts since the last report (``data``: counter name -> int)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine and value:
                per_engine[engine_idx].inc(value)
