"""Reuse tier on real vLLM: a computed prefix is loaded, not recomputed.

One ``kv_both`` engine with fabric's store and a disk tier, and vLLM's own
prefix cache switched off (otherwise vLLM's cache, not fabric's, would
answer the repeat). Oracle: the first run of each prompt on the same engine.

- the same 8-chunk prompt twice: the second time every full chunk comes from
  the store (fabric's metric) and vLLM computes only the tail (vLLM's metric);
- the engine stopped and started again on the same disk directory: the old
  prompt is served from disk; a prompt whose chunk file was corrupted
  meanwhile loads up to that chunk, counts the corrupt file, deletes it, and
  recomputes the rest -- with identical output either way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.launch.process import free_port
from tests.e2e._engines import Engine, EngineFactory
from tests.e2e._pd import CHUNK_TOKENS, assert_same, body, complete, kv_config, metric, prompt_ids

pytestmark = pytest.mark.e2e

FULL_CHUNKS = 8
TAIL = 100
PROMPT_LEN = FULL_CHUNKS * CHUNK_TOKENS + TAIL


class TierEngine:
    """A kv_both engine whose store spills to ``disk``; restartable on the same dir."""

    def __init__(self, engines: EngineFactory, model_dir: Path, disk: Path) -> None:
        self.engines, self.model_dir, self.disk = engines, model_dir, disk
        self.engine = self.start()

    def start(self) -> Engine:
        config = kv_config(
            "kv_both", kv_port=free_port(), disk_path=str(self.disk), disk_gib=1, store_mib=64
        )
        return self.engines.start(
            self.model_dir,
            name="tier",
            cpu_cores="0",
            kv_transfer_config=config,
            extra_args=["--no-enable-prefix-caching"],
        )

    def restart(self) -> None:
        self.engine.process.stop()
        self.engine = self.start()

    def complete(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        return complete(self.engine.url("/v1/completions"), body(prompt))

    def metrics(self) -> dict[str, float]:
        url = self.engine.base_url
        names = [
            "store_hit_chunks",
            "store_hit_tokens",
            "chunks_saved",
            "disk_hit_chunks",
            "disk_corrupt_chunks",
        ]
        out = {name: metric(url, f"vllm:fabric_{name}_total") for name in names}
        out["local"] = metric(url, "vllm:prompt_tokens_by_source_total", source="local_compute")
        out["store_loads"] = metric(url, "vllm:fabric_store_load_seconds_count")
        return out

    def delta(self, before: dict[str, float]) -> dict[str, float]:
        now = self.metrics()
        return {name: now[name] - before.get(name, 0.0) for name in now}


@pytest.fixture(scope="module")
def tier(
    engines: EngineFactory, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TierEngine]:
    yield TierEngine(engines, tiny_model_dir, tmp_path_factory.mktemp("disk-tier"))


def chunk_files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.chunk"))


def wait_for_files(disk: Path, count: int, timeout: float = 60) -> list[Path]:
    """The disk tier writes behind the model step: wait for ``count`` chunk files."""
    deadline = time.monotonic() + timeout
    while len(files := chunk_files(disk)) < count:
        assert time.monotonic() < deadline, f"{len(files)} of {count} chunk files written"
        time.sleep(0.2)
    return files


def test_repeated_prompt_loads_every_full_chunk_from_the_store(tier: TierEngine) -> None:
    prompt = prompt_ids(PROMPT_LEN, seed=500)
    before = tier.metrics()
    first = tier.complete(prompt)
    miss = tier.delta(before)
    assert miss["store_hit_chunks"] == 0
    assert miss["chunks_saved"] == FULL_CHUNKS

    before = tier.metrics()
    second = tier.complete(prompt)
    hit = tier.delta(before)
    assert_same(second, first)
    assert hit["store_hit_chunks"] == FULL_CHUNKS
    assert hit["store_hit_tokens"] == FULL_CHUNKS * CHUNK_TOKENS
    assert hit["local"] == TAIL  # vLLM computed only the tail
    assert hit["chunks_saved"] == 0  # nothing new to keep
    assert hit["store_loads"] == 1  # one latency sample in the histogram


def test_restart_serves_from_disk_and_a_corrupt_file_is_recomputed(tier: TierEngine) -> None:
    x = prompt_ids(PROMPT_LEN, seed=600)
    # y shares x's first 5 chunks; its chunks 5..7 are its own
    y = x[: 5 * CHUNK_TOKENS] + prompt_ids(PROMPT_LEN - 5 * CHUNK_TOKENS, seed=601)
    files_before = set(wait_for_files(tier.disk, 0))
    want_x = tier.complete(x)
    files_x = set(wait_for_files(tier.disk, len(files_before) + FULL_CHUNKS)) - files_before
    want_y = tier.complete(y)
    files_y = set(wait_for_files(tier.disk, len(files_before) + FULL_CHUNKS + 3))
    files_y -= files_before | files_x
    assert len(files_x) == FULL_CHUNKS and len(files_y) == 3

    tier.restart()
    for path in files_y:  # flip one payload byte in each of y's own chunks
        data = bytearray(path.read_bytes())
        data[-1000] ^= 0x5A
        path.write_bytes(bytes(data))

    before = tier.metrics()
    assert_same(tier.complete(x), want_x)
    from_disk = tier.delta(before)
    assert from_disk["store_hit_chunks"] == FULL_CHUNKS
    assert from_disk["disk_hit_chunks"] == FULL_CHUNKS
    assert from_disk["local"] == TAIL

    before = tier.metrics()
    assert_same(tier.complete(y), want_y)
    corrupt = tier.delta(before)
    assert corrupt["store_hit_chunks"] == 5  # x's chunks, in memory since the last request
    assert corrupt["disk_corrupt_chunks"] == 1  # chunk 5: detected, not loaded
    assert corrupt["local"] == PROMPT_LEN - 5 * CHUNK_TOKENS
