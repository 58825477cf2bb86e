"""Connector stats: counters add up, samples concatenate, table sizes are
the latest per source and summed over sources on ``/metrics``."""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import fabric
from fabric.integrations.vllm.counters import COUNTERS, STRICT_ENV, TABLES_KEY, FabricCounters


def test_table_sizes_are_reported_when_they_change_and_summed_over_sources() -> None:
    counters = FabricCounters()
    counters.set_tables("worker0", {"loader_active": 2})
    counters.set_tables("worker1", {"loader_active": 1})
    counters.add(chunks_loaded=3)
    first = counters.take()
    assert first == {
        "chunks_loaded": 3,
        TABLES_KEY: {"worker0": {"loader_active": 2}, "worker1": {"loader_active": 1}},
    }
    counters.set_tables("worker0", {"loader_active": 2})  # unchanged: not reported again
    assert counters.take() == {}
    counters.set_tables("worker0", {"loader_active": 0})
    assert counters.take() == {
        TABLES_KEY: {"worker0": {"loader_active": 0}, "worker1": {"loader_active": 1}}
    }
    assert counters.tables() == {"loader_active": 1}


def test_stats_aggregate_keeps_the_latest_sizes_and_prometheus_shows_their_sum() -> None:
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from fabric.integrations.vllm.stats import FabricPromMetrics, FabricStats

    a = FabricStats(data={"chunks_saved": 1, TABLES_KEY: {"scheduler": {"scheduler_hits": 4}}})
    a.aggregate(FabricStats(data={TABLES_KEY: {"scheduler": {"scheduler_hits": 0}}}))
    a.aggregate(FabricStats(data={TABLES_KEY: {"worker0": {"loader_active": 2}}}))
    assert a.data[TABLES_KEY] == {
        "scheduler": {"scheduler_hits": 0},
        "worker0": {"loader_active": 2},
    }
    assert a.reduce() == {"chunks_saved": 1, "table loader_active": 2, "table scheduler_hits": 0}
    assert not FabricStats(data={TABLES_KEY: {"worker0": {"loader_active": 0}}}).is_empty()

    registry = CollectorRegistry()
    types: dict[type, Any] = {}
    for cls in (Gauge, Counter, Histogram):
        types[cls] = functools.partial(cls, registry=registry)
    config = SimpleNamespace(kv_transfer_config=None)
    prom = FabricPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe({TABLES_KEY: {"worker0": {"loader_active": 2}, "worker1": {"loader_active": 3}}})
    prom.observe({TABLES_KEY: {"worker1": {"loader_active": 0}}, "chunks_loaded": 1})
    prom.observe({"scheduler_hold_seconds": [0.0002, 0.004]})
    labels = {"model_name": "tiny", "engine": "0"}
    value = registry.get_sample_value
    assert value("vllm:fabric_table_entries", labels | {"table": "loader_active"}) == 2
    assert value("vllm:fabric_scheduler_hold_seconds_count", labels) == 2
    assert value("vllm:fabric_chunks_loaded_total", labels) == 1


def test_a_misspelt_counter_is_refused_not_silently_kept() -> None:
    counters = FabricCounters()
    counters.add(chunks_sent=1)
    with pytest.raises(ValueError, match="chunk_sent"):
        counters.add(chunk_sent=1)
    assert counters.take()["chunks_sent"] == 1


def test_outside_tests_a_misspelt_counter_is_logged_once_and_dropped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In an engine a ValueError from a vLLM hook or a fabric thread would
    fail requests: the bug is logged (once) and the rest of the call counted."""
    monkeypatch.delenv(STRICT_ENV)
    counters = FabricCounters()
    for _ in range(3):
        counters.add(chunks_sent=1, chunk_sent_typo_for_this_test=1)
    assert counters.take() == {"chunks_sent": 3}
    logged = [r for r in caplog.records if "chunk_sent_typo_for_this_test" in r.getMessage()]
    assert len(logged) == 1


def test_every_counter_fabric_adds_by_name_is_a_counter() -> None:
    """Every ``counters.add(name=...)`` (and ``**{"name": ...}``) in fabric/
    names a counter: a typo in a path no test takes would only be logged."""
    root = Path(fabric.__file__).parent
    names = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add"
                and ast.unparse(node.func.value).endswith("counters")
            ):
                for keyword in node.keywords:
                    if keyword.arg is not None:
                        names.append((path.name, node.lineno, keyword.arg))
                    elif isinstance(keyword.value, ast.Dict):
                        names += [
                            (path.name, node.lineno, key.value)
                            for key in keyword.value.keys
                            if isinstance(key, ast.Constant)
                        ]
    assert len(names) > 40  # NOTE: the scan finds them
    assert [n for n in names if n[2] not in COUNTERS] == []
