"""The FabricConnector driven in vLLM 0.32's real per-step hook order.

``execute_model`` (``vllm/v1/worker/gpu_model_runner.py``, inherited by the
CPU runner) calls, per step: ``handle_preemptions`` -> (block zeroing and
copies) -> ``bind_connector_metadata`` -> forward -> ``start_load_kv``
(after the forward when the step has no synchronous loads,
``kv_connector_model_runner_mixin.py``) -> ``wait_for_save`` ->
``get_transfer_results`` -> ``clear_connector_metadata``. A request that
finished in step N has its blocks freed and handed to another request, whose
forward in step N+1 rewrites them: the chunks step N's ``wait_for_save``
handed to the pack thread must be packed before that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from fabric.integrations.vllm import worker as worker_module
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.connector import FabricConnector
from fabric.integrations.vllm.metadata import FabricMetadata, LocalLoad, PackChunk, SendPlan
from fabric.integrations.vllm.tier_client import WorkerTierClient
from tests.integrations.test_vllm_worker import BS, CT, caches

CB = CT // BS
TOKENS = list(range(500, 500 + 4 * CT))


def vllm_config(model_dir: Path, extra: dict[str, Any]) -> Any:
    """The parts of a ``VllmConfig`` the connector reads."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra, kv_role="kv_both", engine_id="hook-order"
        ),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, rank=0),
        model_config=SimpleNamespace(
            model=str(model_dir), dtype="bfloat16", revision=None, hf_config=None, quantization=None
        ),
    )


@pytest.fixture
def connector(tmp_path: Path) -> Iterator[FabricConnector]:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    extra = {"transport": "loopback", "chunk_tokens": CT, "store_mib": 4}
    c = FabricConnector(vllm_config(tmp_path, extra), KVConnectorRole.WORKER, None)  # type: ignore[arg-type]
    c.register_kv_caches(caches(7))
    yield c
    c.shutdown()


def step(
    c: FabricConnector, meta: FabricMetadata, forward: Callable[[], None], done: set[str]
) -> None:
    """One ``execute_model`` with an asynchronous-load step, in vLLM's order."""
    c.handle_preemptions(meta)
    c.bind_connector_metadata(meta)
    forward()
    c.start_load_kv(None)
    c.wait_for_save()
    c.get_transfer_results(done)
    c.get_block_ids_with_load_errors()
    c.clear_connector_metadata()


def test_chunks_are_packed_before_the_next_forward_rewrites_freed_blocks(
    connector: FabricConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slowed(real: Callable[..., Any]) -> Callable[..., Any]:
        def slow_pack(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.3)  # NOTE: a busy pack thread: the next step comes first
            return real(*args, **kwargs)

        return slow_pack

    # NOTE: one pack thread packs with pack_checksummed, more with pack
    for name in ("pack", "pack_checksummed"):
        monkeypatch.setattr(worker_module, name, slowed(getattr(worker_module, name)))
    worker = connector._worker
    assert worker is not None and worker._packer is not None
    src = list(range(0, 4 * CB))
    computed = [layer[src].clone() for layer in worker.kv_caches]
    packs = [PackChunk("r1", i, src[i * CB : (i + 1) * CB]) for i in range(4)]
    sends = [SendPlan("r1", None, None, TOKENS, [CB] * 4)]
    step(connector, FabricMetadata(sends=sends, packs=packs), lambda: None, set())

    def forward_of_the_request_that_got_r1s_blocks() -> None:
        for layer in worker.kv_caches:
            layer[src] = 0

    step(connector, FabricMetadata(), forward_of_the_request_that_got_r1s_blocks, {"r1"})
    worker.flush()
    config = ConnectorConfig(chunk_tokens=CT, lookup_timeout_ms=2000)
    client = WorkerTierClient(config, tp_size=1, engine_id="hook-order")
    try:
        assert client.lookup("r2", TOKENS) == 4
    finally:
        client.close()
    dst = list(range(20, 20 + 4 * CB))
    step(connector, FabricMetadata(local_loads=[LocalLoad("r2", 0, dst, 4)]), lambda: None, set())
    for layer, want in zip(worker.kv_caches, computed, strict=True):
        assert torch.equal(layer[dst], want), "a stored chunk is not what the step computed"
