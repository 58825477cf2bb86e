"""FabricConnector: vLLM's KVConnectorBase_V1 over fabric's store and transfer.

Load it with::

    --kv-transfer-config '{"kv_connector": "FabricConnector",
      "kv_connector_module_path": "fabric.integrations.vllm",
      "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"kv_port": 5600, "chunk_tokens": 256}}'

Scheduler side (EngineCore process): :class:`FabricScheduler`. Worker side
(worker process): :class:`FabricWorker`. A prefiller pushes to the decoder
named by the proxy in ``kv_transfer_params``; a decoder loads asynchronously
and reports failures so vLLM recomputes rather than hangs.

Scheduler hold: every scheduler-side hook runs on vLLM's scheduler thread,
so the time spent in them delays the whole engine. The connector adds up
the wall time of each (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``, and the scheduler's ``get_kv_connector_stats``) and
observes the sum once per step into ``scheduler_hold_seconds``. A step ends
with ``build_connector_meta``, called once per ``schedule()``
(``vllm/v1/core/sched/scheduler.py:1529``); its sample covers what the
previous step's ``update_from_output`` and any abort between the steps
(``request_finished``) and this ``schedule()`` held. The lookups it waits
for are bounded (:mod:`fabric.integrations.vllm.tier_client`).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from fabric.errors import ConfigError
from fabric.integrations.vllm.amx import request_amx_tiles
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import FabricCounters
from fabric.integrations.vllm.identity import model_identity
from fabric.integrations.vllm.metadata import FabricMetadata
from fabric.integrations.vllm.scheduler import FabricScheduler
from fabric.integrations.vllm.stats import FabricPromMetrics, FabricStats
from fabric.integrations.vllm.tier_client import SharedTierClient, WorkerTierClient
from fabric.integrations.vllm.worker import FabricWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def _holds_scheduler(
    hook: Callable[Concatenate[FabricConnector, P], R],
) -> Callable[Concatenate[FabricConnector, P], R]:
    """Add the hook's wall time to the step's scheduler hold."""

    @functools.wraps(hook)
    def timed(self: FabricConnector, *args: P.args, **kwargs: P.kwargs) -> R:
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._hold_s += time.perf_counter() - start

    return timed


def _roles(kv_role: str | None) -> tuple[bool, bool]:
    """(produce, consume) for vLLM's kv_role."""
    return {
        "kv_producer": (True, False),
        "kv_consumer": (False, True),
        "kv_both": (True, True),
    }.get(kv_role or "kv_both", (True, True))


def check_kv_cache_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse a KV cache fabric cannot move whole: more than one group
    (hybrid models) or a group that is not plain full attention (sliding
    window, Mamba, ...), whose blocks vLLM frees or rewrites while the
    request still runs (``vllm/v1/kv_cache_interface.py``)."""
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    model = vllm_config.model_config.model
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"FabricConnector: model {model} has {len(groups)} KV cache groups (a hybrid or "
            "sliding-window model); fabric moves a single full-attention group only"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ConfigError(
            f"FabricConnector: model {model} uses {type(spec).__name__} KV cache layers; "
            "fabric moves full attention (FullAttentionSpec, MLAAttentionSpec) only"
        )
    if getattr(spec, "non_causal", False):
        # NOTE: a prefix's KV then depends on the tokens after it; vLLM itself
        # turns prefix caching off for these (vllm/v1/engine/core.py).
        raise ConfigError(
            f"FabricConnector: model {model} attends non-causally (prefix LM): a prefix's "
            "KV depends on what follows it, so it cannot be reused or moved by prefix"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ConfigError(
            f"FabricConnector: pipeline parallel size "
            f"{vllm_config.parallel_config.pipeline_parallel_size} is not supported (the "
            "stages' KV would share one key space); use tensor parallelism"
        )


class FabricConnector(KVConnectorBase_V1):
    """Disaggregated prefill/decode over fabric (push, chunked, verified)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        produce, consume = _roles(transfer.kv_role)
        check_kv_cache_groups(vllm_config, kv_cache_config)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: FabricScheduler | None = None
        self._worker: FabricWorker | None = None
        parallel = vllm_config.parallel_config
        self._tier_client: WorkerTierClient | None = None
        self._shared_client: SharedTierClient | None = None
        self._hold_s = 0.0  # scheduler hold of the step so far
        if role == KVConnectorRole.SCHEDULER:
            counters = FabricCounters()
            if config.reuse:
                self._tier_client = WorkerTierClient(
                    config,
                    tp_size=parallel.tensor_parallel_size,
                    engine_id=transfer.engine_id,
                    counters=counters,
                )
            if self._tier_client is not None and config.shared_store is not None:
                self._shared_client = SharedTierClient(config, self._tier_client, counters)
            self._scheduler = FabricScheduler(
                config,
                block_size,
                produce=produce,
                consume=consume,
                tier=self._tier_client,
                shared=self._shared_client,
                counters=counters,
            )
        else:
            # NOTE: vLLM's CPU attention uses AMX tiles unasked (see amx.py)
            request_amx_tiles()
            self._worker = FabricWorker(
                config,
                produce=produce,
                consume=consume,
                block_size=block_size,
                model=model_identity(vllm_config, config.model_revision),
                tp_rank=getattr(parallel, "rank", 0) % max(1, parallel.tensor_parallel_size),
                tp_size=parallel.tensor_parallel_size,
                engine_id=transfer.engine_id,
                rank=getattr(parallel, "rank", 0),
                microbatched=bool(getattr(parallel, "use_ubatching", False)),
            )

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """First hook of every ``execute_model``: join the packing of the
        previous step before vLLM touches any block (see
        :meth:`FabricWorker.before_step`)."""
        assert self._worker is not None
        self._worker.before_step()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._fabric_meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.pack_layer(layer_name, self._fabric_meta())

    def wait_for_save(self) -> None:
        """Pack and push what the step computed, unless its forward raised.

        vLLM calls this from a ``finally`` around the forward
        (``vllm/v1/worker/kv_connector_model_runner_mixin.py:86-92``), so
        also while the forward's exception propagates (the engine then dies,
        ``vllm/v1/engine/core.py``): the layers it did not reach hold stale
        KV, so the step's chunks are dropped and their pushes failed.
        """
        assert self._worker is not None
        if not self.has_connector_metadata():
            return
        failed = sys.exc_info()[1]
        if failed is not None:
            why = f"the step's forward raised {type(failed).__name__}"
            self._worker.abandon(self._fabric_meta(), why)
            return
        self._worker.pack_step(self._fabric_meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        idle = self.has_connector_metadata() and self._fabric_meta().idle
        finished, failed = self._worker.get_results(finished_req_ids, idle=idle)
        return KVConnectorTransferResults(
            finished_sending=self._worker.take_sent(),
            finished_recving=finished,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> FabricStats | None:
        if self._worker is None:
            return self._scheduler_stats()
        self._worker.sync_tier_counters()
        counts = self._worker.counters.take()
        return FabricStats(data=dict(counts)) if counts else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._tier_client is not None:
            self._tier_client.close()
        if self._shared_client is not None:
            self._shared_client.close()

    @_holds_scheduler
    def _scheduler_stats(self) -> FabricStats | None:
        """The scheduler side's counts (lookups, fetches, hold, tables).

        NOTE: vLLM asks in ``update_from_output`` after it freed the step's
        finished requests (``vllm/v1/core/sched/scheduler.py:2342``): the
        table sizes recorded here are the step's end."""
        assert self._scheduler is not None
        self._scheduler.report_tables()
        counts = self._scheduler.counters.take()
        return FabricStats(data=dict(counts)) if counts else None

    def _fabric_meta(self) -> FabricMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FabricMetadata)
        return meta

    # ------------------------------------------------------------ scheduler side
    @_holds_scheduler
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_holds_scheduler
    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    @_holds_scheduler
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._scheduler.update_state_after_alloc(request, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's metadata; ends the step's scheduler hold (observed once)."""
        assert self._scheduler is not None
        start = time.perf_counter()
        try:
            return self._scheduler.build_connector_meta(scheduler_output)
        finally:
            held, self._hold_s = self._hold_s + time.perf_counter() - start, 0.0
            self._scheduler.counters.observe("scheduler_hold_seconds", held)

    @_holds_scheduler
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # ------------------------------------------------------------ stats
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> FabricStats:
        return FabricStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> FabricPromMetrics:
        return FabricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
