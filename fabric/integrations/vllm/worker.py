"""Worker side of the FabricConnector (runs in vLLM's worker process).

``register_kv_caches`` detects the layout and builds the chunk store, the
reuse tier (optionally with its disk tier), the transfer node (a server on
``kv_port`` when this engine receives or keeps a reuse tier), the push
thread (prefiller) and the load thread (decoder, or any engine with a
``shared_store``: chunks fetched from it load like a decoder's). With a
``shared_store`` every full chunk packed into the store is also handed to
the :class:`SharedSaver`'s push thread.

Hook order this relies on (vLLM 0.32, one ``execute_model`` per step)::

    handle_preemptions(meta)   vllm/v1/worker/gpu_model_runner.py:3968-3971,
                               first thing in execute_model (the CPU runner
                               inherits it): before_step() joins the packing
                               of the previous step
    _update_states             gpu_model_runner.py:1172-1208: zeroes newly
                               allocated blocks, applies block copies
    bind_connector_metadata    kv_connector_model_runner_mixin.py:77
    start_load_kv              mixin.py:83-85 before the forward when the
                               step has synchronous loads, else :88-90 AFTER it
    forward                    writes KV into this step's blocks; after each
                               attention layer ``save_kv_layer``
                               (``vllm/model_executor/layers/attention/
                               kv_transfer_utils.py:54-57``): pack_layer()
                               hands finished layer groups to the pack thread
                               (:mod:`fabric.integrations.vllm.layered`)
    wait_for_save              mixin.py:91-92
    get_transfer_results       mixin.py:94-96

A block the scheduler freed after step N (request finished, or preempted:
``vllm/v1/core/sched/scheduler.py`` ``_free_request`` / ``_preempt_request``)
can be handed to another request in step N+1 and is first written in
execute_model(N+1) after ``handle_preemptions``: so the chunks that step N's
``wait_for_save`` hands to the pack thread are packed before anything can
overwrite them. ``start_load_kv`` cannot be that join: it may run after the
forward.

Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``, vLLM's GPU default
when Triton is present) calls ``update_requests`` (block zeroing and
copy-on-write copies, :1255-1270) before ``handle_preemptions``
(``gpu/kv_connector.py:81``), still before the forward. Neither writes a
block in the KV caches fabric accepts (one full-attention group, see
``connector.check_kv_cache_groups``): zeroing is only for Mamba or
mixed-precision caches (``vllm/v1/kv_cache_interface.py``
``needs_kv_cache_zeroing``), and copies only where the hash block size
differs from the block size, which one group rules out
(``vllm/v1/core/kv_cache_coordinator.py:565``).

Per step:

- ``before_step`` (``handle_preemptions``): join the previous step's packing;
- ``start_load``: unpack the store hits the scheduler held for new
  requests (LocalLoads, synchronous, before the forward pass); hand new
  LoadPlans to the load thread (asynchronous);
- ``save`` (``wait_for_save``): pack the chunks this step completed into
  store slots (on the pack thread with ``async_save``) and hand the
  prefiller's to the push thread;
- ``get_results``: requests whose load finished (and which of them failed);
  then the sizes of this rank's per-request tables are gauged.

Per-request tables (``table_sizes``: this worker's, its load and push
threads', its server's, store's and tier's; gauged every step through
``FabricCounters.set_tables`` and live in the server's ``Stats`` as
``tables.<name>``) empty themselves however a request ends:

- ``_keys``, ``_keep_only`` and ``_shared_chunks`` (a request being packed)
  go with its last chunk, when packing it fails, or when vLLM names it
  finished. vLLM names every request it finishes -- done, stopped or
  aborted -- exactly once, in the ``finished_req_ids`` of the next step:
  every finish path goes through ``_free_request``
  (``vllm/v1/core/sched/scheduler.py:2736``), the set ships with the next
  ``SchedulerOutput`` (:1514) and is reset after it (:1647); that step runs
  even with nothing else to do (``vllm/v1/engine/core.py:665`` asks
  ``has_requests``, true while finished ids wait, ``scheduler.py:2832``),
  and without tokens the runner still calls the connector
  (``vllm/v1/worker/gpu_model_runner.py:3989-4005``, then
  ``kv_connector_model_runner_mixin.py:94-96``). A request finished before
  it ever reached the worker left nothing here to prune.
- Loads end by bounded waits, or at once when their request is named
  finished (:class:`~fabric.integrations.vllm.loader.Loader`); vLLM keeps
  an aborted request's blocks until its load is reported.
- ``_load_errors`` is drained every step (``mixin.py:100``); ``_packing``
  holds only futures not yet done.
- Slot refs go back on every error path: a failed pack aborts its slot, a
  chunk handed to a push thread is released by it, a store hit is released
  after its unpack whatever happened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.errors import CapacityError, ChecksumMismatch, ConfigError, FabricError
from fabric.integrations.vllm.config import endpoint_file
from fabric.integrations.vllm.counters import FabricCounters
from fabric.integrations.vllm.layered import LayeredPacks
from fabric.integrations.vllm.loader import Loader, unpack_slot
from fabric.integrations.vllm.paths import DIRECT, PathChooser
from fabric.integrations.vllm.sender import PushJob, PushSender
from fabric.integrations.vllm.shared import SharedSaver
from fabric.kv import KVLayout, chunk_keys, layerwise, pack, pack_checksummed
from fabric.kv.cuda import load_extension
from fabric.kv.direct import CacheMap, cache_map, cache_regions, cache_spans, checksum_spans
from fabric.kv.pack import settle
from fabric.kv.spans import chunk_spans
from fabric.store import ChunkPool, ChunkStore, StoreConfig
from fabric.store.disk import DiskTier
from fabric.store.pool import HOST_DEVICES, resolve_pool_device
from fabric.store.tier import TieredStore
from fabric.threads import set_os_name
from fabric.transfer import TransferConfig, TransferNode, default_agent_name
from fabric.transfer.store_client import write_endpoint

if TYPE_CHECKING:
    import torch

    from fabric.integrations.vllm.config import ConnectorConfig
    from fabric.integrations.vllm.metadata import FabricMetadata, LocalLoad, PackChunk, SendPlan

logger = logging.getLogger(__name__)

QUARANTINE_MARGIN_MS = 5_000
# NOTE: an engine's receiver with no write outstanding wakes at once for a
# control message or finished offload work; its idle tick only expires
# leases (every expire_interval_ms anyway): 20 wake-ups a second, not 200,
# on an engine's one core.
ENGINE_IDLE_POLL_MS = 50.0
IDLE_STEP_WAIT_S = 0.02  # the longest a step without tokens waits for a load to end


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The control endpoint of TP rank ``rank`` of the decoder at ``endpoint``.

    The proxy names a decoder by its rank-0 endpoint (``tcp://host:kv_port``);
    rank r of a tensor-parallel decoder binds ``kv_port + r`` and holds the
    r-th shard, which rank r of the prefiller produces.
    """
    if rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) + rank < 65536:
        raise ConfigError(f"decode_kv_endpoint {endpoint!r}: no port to offset for TP rank {rank}")
    return f"{head}:{int(port) + rank}"


class FabricWorker:
    """Owns the store, the transfer node and the push/load threads.

    ``rank``: this worker's global rank (vLLM's ``ParallelConfig.rank``;
    ``tp_rank`` when not given), which names its table gauges
    (``worker<rank>``), so no two workers of one engine share a name.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        produce: bool,
        consume: bool,
        block_size: int,
        model: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        engine_id: str | None = None,
        rank: int | None = None,
        microbatched: bool = False,
    ) -> None:
        self.config, self.produce, self.consume = config, produce, consume
        self.microbatched = microbatched
        self.block_size, self.model = block_size, model
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rank = tp_rank if rank is None else rank
        self.counters = FabricCounters()
        self.layout: KVLayout | None = None
        self.node: TransferNode | None = None
        self.sender: PushSender | None = None
        self.loader: Loader | None = None
        self.tier: TieredStore | None = None
        self.shared: SharedSaver | None = None
        self.engine_id = engine_id
        if config.shared_store is not None and tp_size > 1:
            raise ConfigError(
                "kv_connector_extra_config.shared_store: supported with tensor parallel size 1 "
                f"only (this engine has {tp_size})"
            )
        self._keys: dict[str, list[bytes]] = {}
        self._keep_only: set[str] = set()
        self._direct: set[str] = set()  # pushes whose chunks are offered, not packed
        # direct_reads auto: each push's path, chosen per decoder link by its measured cost
        self.paths: PathChooser | None = PathChooser() if config.direct_reads == "auto" else None
        self._measured: dict[str, PushJob] = {}  # of those: pushes whose CPU is added up
        self._load_errors: set[int] = set()
        self._tier_seen: dict[str, int] = {}
        self._shared_chunks: dict[str, int] = {}  # request -> full chunks it shares
        # NOTE: one thread, so packs and the bookkeeping of finished requests
        # run in the order the steps produced them (see ``pack_step``).
        self._packer = (
            ThreadPoolExecutor(
                1,
                thread_name_prefix="fabric-pack",
                initializer=set_os_name,
                initargs=("fabric-pack",),
            )
            if config.async_save
            else None
        )
        self._packing: list[Future[None]] = []
        self.layered: LayeredPacks | None = None
        self._sends_begun: FabricMetadata | None = None  # pack thread: the step begun early
        self._joined = False  # before_step joined the pack thread this step
        # direct_reads: requests whose blocks vLLM keeps after they finish
        # (``request_finished`` said so) until this rank reports them sent
        self._cache_map: CacheMap | None = None
        self._holds = threading.Condition()
        self._holding: set[str] = set()  # held, not reported yet
        self._held_over: set[str] = set()  # of those: no read of their blocks is asked any more
        self._held_finished: set[str] = set()  # of those: vLLM finished them

    # ------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = list(kv_caches.values())
        self._named_caches = kv_caches
        layout = KVLayout.from_tensors(
            kv_caches, model=self.model, tp_rank=self.tp_rank, tp_size=self.tp_size
        )
        if layout.block_size != self.block_size:
            raise ConfigError(
                f"KV cache block size {layout.block_size} != vLLM's {self.block_size}"
            )
        self.layout = layout
        chunk_blocks = self.config.chunk_tokens // self.block_size
        slot_bytes = layout.chunk_nbytes(chunk_blocks)
        num_slots = self.config.store_slots or max(4, (self.config.store_mib << 20) // slot_bytes)
        # NOTE: a slot whose write may still be in flight (its reservation
        # expired or was cancelled) waits out the longest write's life first.
        quarantine_ms = int(self.config.push_timeout_s * 1000) + QUARANTINE_MARGIN_MS
        device = self._pool_device()
        try:
            pool = ChunkPool(num_slots, slot_bytes, device=device)
        except ConfigError as exc:
            raise ConfigError(f"pool_device: {exc}") from exc
        if any(t.device.type == "cuda" for t in self.kv_caches):
            # NOTE: now, not on the first chunk: without a prebuilt extension
            # this compiles it (minutes), which must not eat a load's timeout
            implementation = "fused kernels" if load_extension() else "torch indexing"
            logger.info("fabric: CUDA KV cache; packing with %s", implementation)
        store = ChunkStore(
            StoreConfig(slot_bytes=slot_bytes, num_slots=num_slots, quarantine_ms=quarantine_ms),
            pool,
        )
        self.store = store
        if self.config.reuse:
            self.tier = TieredStore(
                store,
                chunk_tokens=self.config.chunk_tokens,
                fingerprint=layout.fingerprint(),
                disk=self._disk_tier(),
            )
        serve = self.consume or self.tier is not None
        self.node = TransferNode(
            store,
            self._transfer_config(serve),
            layout.fingerprint(),
            name=default_agent_name(f"fabric-{'d' if self.consume else 'p'}{self.tp_rank}"),
            serve=serve,
            tier=self.tier,
        )
        if serve and self.engine_id is not None and not self.config.kv_port:
            self._publish_endpoint(self.node.endpoint)
        logger.info(
            "fabric: %s layout, %d layers, %d-token chunks of %.1f MiB, %d slots in %s, %s%s%s",
            layout.kind.value,
            layout.num_layers,
            self.config.chunk_tokens,
            slot_bytes / 2**20,
            num_slots,
            pool.device,
            self.node.plane.kind,
            f", serving on {self.node.endpoint}" if serve else "",
            self._tier_description(),
        )
        if self.produce and self.config.direct_reads is True:
            self._cache_map = self._register_cache(layout)
        elif self.produce and self.config.direct_reads == "auto":
            self._cache_map = self._register_cache_if_readable(layout)
        if self._cache_map is None:
            self.paths = None  # NOTE: every push is staged: nothing to choose
        if self.consume and self.node.server is not None and self.node.plane.reads:
            self.node.server.enable_reads(layout)
        self._setup_layered(layout)  # NOTE: after the cache map: offered chunks are hashed too
        if self.produce:
            self.sender = PushSender(
                self.node.client,
                store,
                self.counters,
                lease_ms=self.config.lease_ms,
                push_timeout_s=self.config.push_timeout_s,
                cache=self._cache_map,
                num_layers=layout.num_layers,
                on_over=self._push_over,
                paths=self.paths,
            )
        if self.config.shared_store is not None:
            self.shared = SharedSaver(
                self.config,
                self.node.client,
                store,
                self.counters,
                fingerprint=layout.fingerprint(),
                chunk_bytes=slot_bytes,
                own_endpoint=self.node.endpoint,
            )
        if self.consume or self.shared is not None:
            assert self.node.server is not None
            self.loader = Loader(
                self.node.server,
                store,
                layout,
                self.kv_caches,
                self.counters,
                chunk_tokens=self.config.chunk_tokens,
                block_size=self.block_size,
                load_timeout_s=self.config.load_timeout_s,
                unknown_grace_s=self.config.unknown_transfer_grace_s,
                lease_ms=self.config.lease_ms,
                pack_threads=self.config.pack_threads,
                waiting_hold_s=self.config.waiting_hold_s,
            )

        if self.node.server is not None:
            self.node.server.extra_stats.append(self.thread_health)
            self.node.server.extra_tables.append(self.own_table_sizes)

    def _pool_device(self) -> str:
        """Where the chunk pool goes (``pool_device``; see ConnectorConfig)."""
        devices = {str(t.device) for t in self.kv_caches}
        if self.config.pool_device in HOST_DEVICES or devices == {"cpu"}:
            return resolve_pool_device(self.config.pool_device, devices)
        host_only = None
        transport = self._transfer_config(False).resolved_transport()
        if transport != "nixl":
            host_only = f"the {transport} transport moves host memory only"
        elif self.config.shared_store is not None:
            host_only = "the shared store keeps and verifies chunks in host memory"
        return resolve_pool_device(self.config.pool_device, devices, host_only)

    def _register_cache(self, layout: KVLayout) -> CacheMap:
        """direct_reads: register the KV cache with the data plane (its
        registration goes to decoders in Offers, never in the descriptor a
        Hello carries) and describe it for readers.

        With ``local_reads`` the plane first moves the cache's pages onto a
        shared memory file (:func:`fabric.transfer.local_read.share_region`),
        which loses any write made to them meanwhile. None is: vLLM calls
        ``register_kv_caches`` from the model runner's ``initialize_kv_cache``
        (``vllm/v1/worker/gpu_model_runner.py:7119``, the CPU runner's
        inherits it), inside ``initialize_from_config``
        (``vllm/v1/engine/core.py:377``), before the warm-up's first forward
        (``compile_or_warm_up_model``, ``core.py:379``) and before the engine
        serves (the V2 runner likewise: ``vllm/v1/worker/gpu/model_runner.py:798``
        -> ``gpu/kv_connector.py:64``); no fabric thread touches the cache
        before this returns. NOTE: under vLLM's ``MultiConnector`` a
        connector registered before fabric that pinned or registered the
        cache's pages would keep the old ones: list fabric first there, or
        set ``local_reads: false``."""
        assert self.node is not None
        plane = self.node.plane
        devices = {str(t.device) for t in self.kv_caches}
        if devices != {"cpu"}:
            raise ConfigError(
                f"direct_reads: the KV cache is on {', '.join(sorted(devices))}; decoders "
                "read it directly only from host memory (for now)"
            )
        if not plane.reads:
            raise ConfigError(f"direct_reads: the {plane.kind} transport cannot read a peer")
        for base, nbytes in cache_regions(self._named_caches):
            plane.register_region(base, nbytes)
        logger.warning(
            "fabric: direct_reads: this engine's KV cache is registered with its data plane; "
            "a decoder it offers chunks to (one that answered its Hello and granted a Reserve) "
            "can read and write it"
        )
        return cache_map(self.kv_caches, layout)

    def _register_cache_if_readable(self, layout: KVLayout) -> CacheMap | None:
        """direct_reads auto: register the cache where a decoder can read it
        (host memory, a data plane that reads); else every push is staged."""
        assert self.node is not None
        try:
            return self._register_cache(layout)
        except FabricError as exc:  # NOTE: a GPU cache, a plane that cannot read, ...
            logger.warning("fabric: %s (direct_reads auto: every push is staged)", exc)
            return None

    def threads_down(self) -> list[str]:
        """Names of the fabric threads of this worker that are no longer running."""
        owners = [self.loader, self.sender, self.shared.sender if self.shared else None]
        return [o.thread.name for o in owners if o is not None and not o.thread.is_alive()]

    def thread_health(self) -> dict[str, int]:
        """For Stats: a decoder with a thread down reports unhealthy (the proxy
        stops sending it work; see ``fabric.router.engines.probe``)."""
        return {"threads_down": len(self.threads_down())}

    def _setup_layered(self, layout: KVLayout) -> None:
        """Layer-wise packing with ``layer_groups`` > 1, where the cache allows it."""
        groups = self.config.layer_groups
        if groups <= 1:
            return
        if (
            self.config.pack_threads != 1
            or self.microbatched
            or not layerwise.supported(self._named_caches)
            or not self.store.pool.is_host  # NOTE: groups are hashed with xxh3 as they go
        ):
            # NOTE: microbatches (vLLM's ubatching) run each attention layer
            # once per microbatch: its first save_kv_layer comes before the
            # second microbatch wrote its KV
            logger.info(
                "fabric: layer_groups %d: chunks are packed at the end of each step here "
                "(layer-wise packing needs a CPU KV cache, fabric.kv._copy, pack_threads 1 "
                "and no microbatching)",
                groups,
            )
            return
        on_part = self._part_packed if self.config.layer_writes else None
        offering = self._cache_map is not None
        self.layered = LayeredPacks(
            self.store,
            self._named_caches,
            layout,
            groups,
            self.counters,
            on_part,
            self._part_dropped,
            self._direct.__contains__ if offering else None,
            self._part_hashed if offering else None,
            self._pack_cpu if self.paths is not None and offering else None,
        )

    def _part_packed(self, req_id: str, index: int, slot: int, layers: int, nbytes: int) -> None:
        """Layers of a chunk packed during the forward: its push writes them
        now (pack thread; a request only kept here, or unknown, has none)."""
        if self.sender is not None and req_id in self._keys and req_id not in self._keep_only:
            self.sender.part(req_id, index, slot, layers, nbytes)

    def _part_hashed(self, req_id: str, parts: list[tuple[int, list[int], int]]) -> None:
        """direct_reads: layers of a request's chunks hashed during the forward
        (``(index, block_ids, layers)``, final in their blocks:
        :mod:`~fabric.integrations.vllm.layered`) are offered now, together,
        so the decoder reads them while the later layers are computed (pack
        thread)."""
        if self.sender is not None and req_id in self._direct:
            self.sender.offer_parts(req_id, parts)

    def _part_dropped(self, req_id: str, index: int) -> None:
        """The slot a chunk's parts were written from went back to the store."""
        if self.sender is not None:
            self.sender.part_dropped(req_id, index)

    def own_table_sizes(self) -> dict[str, int]:
        """Entries in the per-request tables of this worker, its load thread
        and its push threads (name -> entries)."""
        sizes = {
            "worker_keys": len(self._keys),
            "worker_keep_only": len(self._keep_only),
            "worker_direct": len(self._direct),
            "worker_measured": len(self._measured),
            **(self.paths.table_sizes() if self.paths is not None else {}),
            "worker_shared_chunks": len(self._shared_chunks),
            "worker_load_errors": len(self._load_errors),
            "worker_packing": sum(not f.done() for f in list(self._packing)),
            "worker_holding": len(self._holding),
        }
        if self.layered is not None:
            sizes |= self.layered.table_sizes()
        if self.loader is not None:
            sizes |= self.loader.table_sizes()
        # NOTE: each push thread names its own (``sender_*``, ``shared_sender_*``).
        for sender in (self.sender, self.shared.sender if self.shared else None):
            sender_sizes = getattr(sender, "table_sizes", None)
            if sender_sizes is not None:
                sizes |= sender_sizes()
        return sizes

    def table_sizes(self) -> dict[str, int]:
        """Every per-request table of this rank: its own, the server's, the
        store's and the tier's (what the server's Stats reply holds too)."""
        server = self.node.server if self.node is not None else None
        if server is not None:
            return server.table_sizes()  # NOTE: which includes own_table_sizes
        sizes = self.own_table_sizes()
        if getattr(self, "store", None) is not None:
            sizes |= self.store.table_sizes()
        if self.tier is not None:
            sizes |= self.tier.table_sizes()
        return sizes

    def report_tables(self) -> None:
        """Gauge this rank's table sizes (once per step, from ``get_results``);
        a failure is logged and counted, never raised into vLLM's step."""
        try:
            self.counters.set_tables(f"worker{self.rank}", self.table_sizes())
        except Exception:
            self.counters.add(thread_errors=1)
            logger.exception("fabric: reading the table sizes failed")

    def _publish_endpoint(self, endpoint: str) -> None:
        assert self.engine_id is not None
        path = endpoint_file(self.engine_id, self.tp_rank)
        write_endpoint(path, endpoint)
        self._endpoint_path: Path | None = path

    def _disk_tier(self) -> DiskTier | None:
        path = self.config.disk_path
        if not path:
            return None
        if self.tp_size > 1:
            path = os.path.join(path, f"tp{self.tp_rank}")
        return DiskTier(path, int(self.config.disk_gib * 2**30))

    def _tier_description(self) -> str:
        if self.tier is None:
            return ", no reuse tier"
        disk = self.tier.disk
        if disk is None:
            return ", reuse tier in memory"
        stats = disk.stats()
        return (
            f", reuse tier with disk {self.config.disk_path} "
            f"({stats.files} chunks, {stats.bytes / 2**30:.2f} of "
            f"{stats.budget_bytes / 2**30:.1f} GiB)"
        )

    def _transfer_config(self, serve: bool) -> TransferConfig:
        c = self.config
        port = c.kv_port + self.tp_rank if c.kv_port and serve else 0
        return TransferConfig(
            transport=c.transport,
            host=c.host,
            advertise_host=c.advertise_host,
            insecure=c.insecure,
            port=port,
            lease_ms=c.lease_ms,
            write_timeout_ms=int(c.push_timeout_s * 1000),
            nixl_progress_thread=c.nixl_progress_thread,
            ucx_net_devices=c.ucx_net_devices or os.environ.get("UCX_NET_DEVICES"),
            local_reads=c.local_reads,
            secret=c.resolved_secret(),
            faults=c.faults,
            idle_poll_interval_ms=ENGINE_IDLE_POLL_MS,
        )

    # ------------------------------------------------------------ per step
    def before_step(self) -> None:
        """Join the packing of the previous step: vLLM has not touched a block
        of this step yet (see the module docstring for the hook order)."""
        self.flush()
        self._joined = True
        self._sends_begun = None
        if self.layered is not None:
            self.layered.reset()  # NOTE: the pack thread is idle now

    def start_load(self, meta: FabricMetadata) -> None:
        # NOTE: a backstop for a caller that skipped before_step; not after it
        # (this may run after the forward, with its layer groups being packed)
        if not self._joined:
            self.flush()
        held = [plan.req_id for plan in meta.sends if plan.hold]
        if held:  # NOTE: every step calls this, before its get_results
            with self._holds:
                self._holding.update(held)
        for rid in meta.releases:
            if self.tier is not None:
                # NOTE: may run while the lookup it answers still reads from
                # disk on a server thread: that lookup then keeps nothing
                # (see ``fabric.store.tier``), so no hold waits out its lease.
                self.tier.release_hold(rid)
        for local in meta.local_loads:
            self._load_local(local)
        if meta.claims or meta.unclaims or meta.loads:
            if self.loader is None:
                raise ConfigError("a LoadPlan reached a worker that does not consume KV")
            for claim in meta.claims:  # NOTE: before the loads: a claim comes first
                self.loader.claim(claim)
            for rid in meta.unclaims:
                self.loader.unclaim(rid)
            for plan in meta.loads:
                self.loader.submit(plan)

    def _load_local(self, load: LocalLoad) -> None:
        """Unpack the chunks the scheduler held for a request (before the forward).

        Any failure -- the hold gone, a chunk corrupt at use, anything else --
        marks the request's blocks as load errors: vLLM recomputes them. It
        never raises into vLLM's ``execute_model``.
        """
        held = self.tier.take_held(load.req_id) if self.tier is not None else None
        if held is None or len(held[0]) < load.num_chunks:
            logger.warning(
                "fabric: the store chunks held for request %s are gone (%s of %d); "
                "vLLM recomputes them",
                load.req_id,
                "none" if held is None else len(held[0]),
                load.num_chunks,
            )
            self._load_errors.update(load.block_ids)
            self.counters.add(store_load_failures=1)
            if held is not None and held[0]:
                self.store.release_slots(held[0])
            return
        slots, keys = held
        started = time.monotonic()
        try:
            corrupt = self._unpack_held(load, slots, keys)
        except Exception:
            logger.exception("fabric: loading the store hit of %s failed", load.req_id)
            self.counters.add(thread_errors=1)
            corrupt = b""
        self.store.release_slots(slots)
        if corrupt is not None:
            self._load_errors.update(load.block_ids)
            self.counters.add(store_load_failures=1)
            if corrupt:
                self.counters.add(corrupt_chunks=1)
                self.store.discard(corrupt)  # NOTE: later lookups miss it, not fail again
            return
        chunk_blocks = self.config.chunk_tokens // self.block_size
        tokens = load.num_chunks * self.config.chunk_tokens - load.first_block * self.block_size
        self.counters.observe("store_load_seconds", time.monotonic() - started)
        self.counters.add(
            store_hit_chunks=load.num_chunks - load.first_block // chunk_blocks,
            store_hit_tokens=tokens,
        )

    def _unpack_held(self, load: LocalLoad, slots: list[int], keys: list[bytes]) -> bytes | None:
        """Unpack held chunks into the request's blocks; the key of the first
        chunk found corrupt at use (its checksum, or its slot holding another
        key), or None when all verified."""
        assert self.layout is not None
        chunk_blocks = self.config.chunk_tokens // self.block_size
        counts = [chunk_blocks] * load.num_chunks  # NOTE: a store holds full chunks only
        for span in chunk_spans(load.first_block, load.block_ids, counts, chunk_blocks):
            try:
                unpack_slot(
                    self.store,
                    slots[span.index],
                    self.kv_caches,
                    self.layout,
                    span,
                    keys[span.index],
                )
            except ChecksumMismatch as exc:
                logger.error("fabric: a store chunk of %s is corrupt at use: %s", load.req_id, exc)
                return keys[span.index]
        return None

    def sync_tier_counters(self) -> None:
        """Add what the reuse tier's monotonic counters moved since the last call."""
        if self.tier is None:
            return
        now = {"disk_hit_chunks": self.tier.counters.disk_hit_chunks}
        disk = self.tier.disk
        if disk is not None:
            stats = disk.stats()
            now |= {
                "disk_corrupt_chunks": stats.corrupt,
                "disk_writes": stats.writes,
                "disk_write_failures": stats.write_failures,
                "disk_evictions": stats.evictions,
            }
        deltas = {k: v - self._tier_seen.get(k, 0) for k, v in now.items()}
        self._tier_seen = now
        if any(deltas.values()):
            self.counters.add(**{k: v for k, v in deltas.items() if v})

    def take_load_errors(self) -> set[int]:
        """Blocks whose synchronous load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def pack_step(self, meta: FabricMetadata) -> None:
        """Pack the chunks this step completed (and start their pushes).

        With ``async_save`` the packing runs on the ``fabric-pack`` thread
        while the engine samples, returns the step and schedules the next
        one, and ``before_step`` joins it before vLLM touches a block of the
        next step. That join is what makes it safe: blocks it frees or hands
        to another request after this step (a finished or preempted request)
        still hold this step's KV until the pack is done.

        On a GPU the forward is only enqueued when ``wait_for_save`` runs
        (on vLLM's stream): the pack thread first waits for an event recorded
        on that stream here, so it packs the KV the step computed.
        """
        if not meta.sends and not meta.packs:
            return
        if self._packer is None:
            self._pack_now(meta)
        else:
            self._submit(self._pack_after, (meta, self._forward_done()))

    def _forward_done(self) -> Any:
        """A CUDA event recorded on the caller's stream (None for CPU caches)."""
        first = self.kv_caches[0] if self.kv_caches else None
        if first is None or first.device.type != "cuda":
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(first.device))
        return event

    def _pack_after(self, job: tuple[FabricMetadata, Any]) -> None:
        meta, forward_done = job
        if forward_done is not None:
            forward_done.synchronize()
        self._pack_now(meta)

    def _pack_now(self, meta: FabricMetadata) -> None:
        """Begin the step's pushes and pack its chunks; an exception fails the
        request it served (its push is given up, so the decoder recomputes at
        once) and the rest of the step is still packed. Pushes a layer group
        began during the forward are not begun again, and chunks it partly
        packed are finished (:mod:`~fabric.integrations.vllm.layered`)."""
        begun = self._sends_begun is meta
        self._sends_begun = None
        if not begun:
            for plan in meta.sends:
                self._guarded(plan.req_id, self._begin, plan)
        try:
            for chunk in meta.packs:
                self._guarded(chunk.req_id, self._pack_chunk, chunk)
        finally:
            if self.layered is not None:
                self.layered.end()

    def pack_layer(self, layer_name: str, meta: FabricMetadata) -> None:
        """``save_kv_layer``: once a layer group of the step is saved, hand
        its packing to the pack thread (see :mod:`~fabric.integrations.vllm.layered`)."""
        if self.layered is None:
            return
        try:
            upto = self.layered.layer_packed(layer_name, meta)
            if upto is None:
                return
            if self._packer is None:
                self._pack_layers((meta, upto))
            else:
                self._submit(self._pack_layers, (meta, upto))
        except Exception:
            # NOTE: never raised into vLLM's forward; what is not packed now
            # is packed at the step's end
            self.counters.add(thread_errors=1)
            logger.exception("fabric: packing layers up to %s failed", layer_name)

    def _pack_layers(self, job: tuple[FabricMetadata, int]) -> None:
        """The first group of a step begins its pushes (once: ``_pack_now``
        then does not) and takes its slots."""
        meta, upto = job
        assert self.layered is not None
        if self._sends_begun is not meta:
            for plan in meta.sends:
                self._guarded(plan.req_id, self._begin, plan)
            self._sends_begun = meta
            self.layered.prepare(meta, self._key_to_pack)
        self.layered.pack(meta, upto)

    def abandon(self, meta: FabricMetadata, why: str) -> None:
        """``wait_for_save`` while the step's forward raised: its chunks hold
        layers never computed, so nothing of it is packed, kept or pushed;
        the pushes of its requests fail (their decoders recompute)."""
        if self._packer is None:
            self._abandon((meta, why))
        else:
            self._submit(self._abandon, (meta, why))

    def _abandon(self, job: tuple[FabricMetadata, str]) -> None:
        meta, why = job
        self._sends_begun = None
        if self.layered is not None:
            self.layered.end()
        requests = {plan.req_id for plan in meta.sends} | {c.req_id for c in meta.packs}
        for rid in requests:
            self._drop_packing(rid)  # NOTE: its later chunks are not packed either
            if self.sender is not None:
                self.sender.fail(rid, why)
        logger.error("fabric: %s: the chunks of %d request(s) dropped", why, len(requests))

    def _drop_packing(self, req_id: str) -> None:
        """Forget ``req_id``'s keys: no later chunk of it is packed."""
        self._keys.pop(req_id, None)
        self._keep_only.discard(req_id)
        self._direct.discard(req_id)
        self._measured.pop(req_id, None)
        self._shared_chunks.pop(req_id, None)

    def _key_to_pack(self, chunk: PackChunk) -> bytes | None:
        keys = self._keys.get(chunk.req_id)
        return keys[chunk.index] if keys is not None and chunk.index < len(keys) else None

    def _guarded(self, req_id: str, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except Exception as exc:
            self.counters.add(thread_errors=1)
            logger.exception("fabric: packing for request %s failed", req_id)
            self._drop_packing(req_id)  # NOTE: its later chunks are skipped
            if self.sender is not None:
                self.sender.fail(req_id, f"packing failed: {type(exc).__name__}: {exc}")

    def _submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        assert self._packer is not None
        self._packing = [f for f in self._packing if not f.done()]
        future = self._packer.submit(fn, arg)
        future.add_done_callback(self._saved)
        self._packing.append(future)

    def _saved(self, future: Future[None]) -> None:
        """A failed save is logged and counted; the engine keeps serving and
        those chunks are simply not kept or pushed."""
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            logger.error("fabric: packing a step's chunks failed", exc_info=exc)
            self.counters.add(thread_errors=1)

    def flush(self) -> None:
        """Wait until every save handed over so far is done (packed, handed
        to the push threads)."""
        packing, self._packing = self._packing, []
        if packing:
            wait(packing)

    def _begin(self, plan: SendPlan) -> None:
        assert self.layout is not None
        keys = chunk_keys(
            plan.token_ids,
            self.config.chunk_tokens,
            self.layout.fingerprint(),
            identity=plan.identity,
        )
        self._keys[plan.req_id] = keys
        path = self._path(plan)
        direct = path == DIRECT
        if self.shared is not None and not direct:  # NOTE: a direct push packs nothing to share
            full = len(plan.token_ids) // self.config.chunk_tokens
            self._shared_chunks[plan.req_id] = full
            self.shared.begin(plan.req_id, keys[:full])
        if plan.endpoint is None or plan.transfer_id is None:
            self._keep_only.add(plan.req_id)
            return
        if self.sender is None:
            raise ConfigError("a push reached a worker that does not produce KV")
        nbytes = [self.layout.chunk_nbytes(n) for n in plan.chunk_blocks]
        try:
            endpoint = rank_endpoint(plan.endpoint, self.tp_rank)
        except ConfigError as exc:
            logger.warning("fabric push %s: %s; the decoder recomputes", plan.req_id, exc)
            self.counters.add(push_failures=1)
            self._keep_only.add(plan.req_id)  # still kept for reuse here
            return
        if direct:
            self._direct.add(plan.req_id)
        job = PushJob(plan.req_id, plan.transfer_id, endpoint, keys, nbytes)
        if self.paths is not None and path:
            job.path = path
            self._measured[plan.req_id] = job
            self.counters.add(**{f"pushes_{path}": 1})
        self.sender.begin(job)

    def _path(self, plan: SendPlan) -> str:
        """The path of ``plan``'s push: direct (offered), staged (packed and
        written), or "" (packed, not measured: no hold, no cache map, no
        decoder); with ``direct_reads: auto`` chosen per decoder link."""
        if not plan.hold or self._cache_map is None or plan.endpoint is None:
            return ""
        if self.paths is None:
            return DIRECT
        try:
            endpoint = rank_endpoint(plan.endpoint, self.tp_rank)
        except ConfigError:
            return ""  # NOTE: _begin says why and keeps the chunks here only
        if self.node is not None and not self.node.client.may_offer(endpoint):
            return ""  # NOTE: an Offer there would be refused: packed, not measured
        assert self.layout is not None
        nbytes = sum(self.layout.chunk_nbytes(n) for n in plan.chunk_blocks)
        return self.paths.choose(endpoint, nbytes)

    def _pack_chunk(self, chunk: PackChunk) -> None:
        keys = self._keys.get(chunk.req_id)
        if keys is None:
            return
        try:
            if chunk.req_id in self._keep_only:
                self._keep_local(chunk, keys)
            else:
                self._push_chunk(chunk, keys)
        finally:
            if chunk.index == len(keys) - 1:  # NOTE: its last chunk: nothing more to save
                if chunk.req_id not in self._direct:
                    # NOTE: a held push that is not read from the blocks (staged,
                    # kept only) needs them no more: vLLM may free them
                    self._push_over(chunk.req_id)
                self._drop_packing(chunk.req_id)

    def _push_chunk(self, chunk: PackChunk, keys: list[bytes]) -> None:
        """Pack a computed chunk (unless the store has it) and hand it to the
        push thread; with direct_reads, hash it in place and offer it."""
        assert self.sender is not None
        cpu = time.thread_time()
        if chunk.req_id in self._direct:
            self._offer_chunk(chunk, cpu)
            return
        key = keys[chunk.index]
        slots = self.store.acquire([key])  # packed before (same prefix): reuse it
        if not slots:
            try:
                self._pack_new(chunk, key)
            except CapacityError as exc:
                logger.warning(
                    "fabric: no slot to pack %s chunk %d: %s", chunk.req_id, chunk.index, exc
                )
                self.counters.add(push_failures=1)
                return
            slots = self.store.acquire([key])
        if slots:
            self._pack_cpu(chunk.req_id, time.thread_time() - cpu)  # NOTE: before it goes
            self.sender.chunk(chunk.req_id, chunk.index, slots[0])  # NOTE: it owns the ref now
            self._share(chunk.req_id, chunk.index, key)

    def _pack_cpu(self, req_id: str, seconds: float) -> None:
        """CPU this (pack) thread spent on a measured push (direct_reads
        auto): added before the chunk it is for is handed over, so its push
        cannot have ended without it."""
        job = self._measured.get(req_id)
        if job is not None:
            job.pack_cpu_s += seconds

    def _offer_chunk(self, chunk: PackChunk, cpu: float = 0.0) -> None:
        """direct_reads: the chunk's checksum, taken in its blocks once they
        are final, is offered with the block ids; the decoder reads them and
        checks that checksum, so blocks reused before it read them (a
        preemption, a push that gave up) fail its load instead of landing
        as this prompt's KV. This runs where a pack would: after the step
        that computed the chunk, before the next one writes a block. With
        layer groups its leading groups were hashed (and offered) during
        the forward as each was saved (:mod:`~fabric.integrations.vllm.
        layered`: that they were final then rests on vLLM's hook order, which
        no checksum can check); only the rest is hashed here."""
        assert self.sender is not None and self.layout is not None
        begun = self.layered.take_hash(chunk) if self.layered is not None else None
        if begun is not None:
            checksum = begun.finish()  # NOTE: its leading layers were offered already
        else:
            spans = cache_spans(self.kv_caches, self.layout, chunk.block_ids)
            checksum = checksum_spans(spans.addrs, spans.lengths)
        if cpu:
            self._pack_cpu(chunk.req_id, time.thread_time() - cpu)
        self.sender.offer(chunk.req_id, chunk.index, list(chunk.block_ids), checksum)

    def _pack_new(self, chunk: PackChunk, key: bytes) -> int:
        """Pack ``chunk`` into a new slot committed as ``key`` (finishing the
        layer-wise pack begun during the forward, if one was); CapacityError
        when no slot is free. Returns the chunk's bytes."""
        begun = self.layered.take(chunk) if self.layered is not None else None
        if begun is None:
            return self._pack_into(self.store.allocate(key), key, chunk.block_ids)
        slot, part = begun
        try:
            nbytes, checksum = part.finish()
        except BaseException:
            self.store.abort(slot)
            raise
        self.store.commit(slot, key, nbytes, checksum)
        self.counters.add(chunks_packed_layerwise=1)
        return nbytes

    def _pack_into(self, slot: int, key: bytes, block_ids: list[int]) -> int:
        """Pack ``block_ids`` into the allocated ``slot`` and commit it as
        ``key``; on failure the slot goes back (nothing half-packed stays)."""
        assert self.layout is not None
        view = self.store.pool.slot_view(slot)
        try:
            if self.config.pack_threads == 1:
                # NOTE: one thread: the checksum is taken as the copy reads (no pass of its own)
                nbytes, checksum = pack_checksummed(self.kv_caches, self.layout, block_ids, view)
            else:
                nbytes, checksum = (
                    pack(
                        self.kv_caches,
                        self.layout,
                        block_ids,
                        view,
                        num_threads=self.config.pack_threads,
                    ),
                    None,
                )
            if not self.store.pool.is_host:
                # NOTE: a VRAM pool's chunks are hashed with its fold64, by
                # commit, on a stream of the hash's own: wait for the pack
                # first (its copies run on a side stream); then the slot is
                # complete before commit hashes it and the sender WRITEs it
                settle(view.device)
                checksum = None
        except BaseException:
            with contextlib.suppress(Exception):
                settle(view.device)  # NOTE: a copy already launched must end before reuse
            self.store.abort(slot)
            raise
        self.store.commit(slot, key, nbytes, checksum)  # NOTE: gives the slot back if it fails
        return nbytes

    def _share(self, req_id: str, index: int, key: bytes) -> None:
        """Hand a full chunk present in the store to the shared store's push thread."""
        if self.shared is None or index >= self._shared_chunks.get(req_id, 0):
            return
        slots = self.store.acquire([key])  # a ref of its own; the push thread releases it
        if not slots:
            return
        try:
            self.shared.chunk(req_id, index, slots[0])
        except BaseException:
            self.store.release_slots(slots)
            raise

    def _keep_local(self, chunk: PackChunk, keys: list[bytes]) -> None:
        """Reuse tier: pack a computed chunk into the store unless it is there."""
        assert self.layout is not None
        key = keys[chunk.index]
        if self.store.contains(key):
            self._share(chunk.req_id, chunk.index, key)
            return
        try:
            nbytes = self._pack_new(chunk, key)
        except CapacityError as exc:
            logger.info("fabric: no slot to save %s chunk %d: %s", chunk.req_id, chunk.index, exc)
            return
        self.counters.add(chunks_saved=1, bytes_saved=nbytes)
        self._share(chunk.req_id, chunk.index, key)

    def get_results(
        self, finished_req_ids: set[str], *, idle: bool = False
    ) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) since the last step.

        ``finished_req_ids``: the requests vLLM finished (done, aborted,
        stopped) since the previous step; see the module docstring for why
        every request the worker saw is named here once.

        ``idle``: the step schedules no token. vLLM then runs only the
        connector (``kv_connector_no_forward``,
        ``vllm/v1/worker/kv_connector_model_runner_mixin.py:25-37``, which
        asks for these results at :93-96) and, while requests wait for
        remote KV, steps again after a 1 ms sleep
        (``vllm/v1/engine/core.py:1611-1617``): about a thousand empty steps a
        second for as long as a decoder admitted at dispatch waits for a
        prefill, burning the cores its prefiller needs. Such a step waits
        here until a load ends, at most ``IDLE_STEP_WAIT_S``: a load's end
        still reaches vLLM at once, a new request waits at most that long.
        """
        if finished_req_ids:
            if self._packer is None:
                self._forget(finished_req_ids)
            else:  # after the packs of the same step, on the same thread
                self._submit(self._forget, set(finished_req_ids))
            if self.loader is not None:
                self.loader.finished(set(finished_req_ids))
        results: tuple[set[str], set[str]] = (set(), set())
        if self._holding:
            with self._holds:
                self._held_finished.update(finished_req_ids & self._holding)
        if self.loader is not None:
            if idle and not finished_req_ids:
                self.loader.wait_results(IDLE_STEP_WAIT_S)
            results = self.loader.take_results()
            if self._held_finished and results[0] & self._held_finished:
                self._drop_holds(results[0])
        waited = self.loader is not None and self.loader.busy  # NOTE: for its loads, above
        if idle and not finished_req_ids and self._held_finished and not waited:
            self._wait_holds()

        self.report_tables()
        self._joined = False  # NOTE: the step ends here; the next one joins again
        return results

    def take_sent(self) -> set[str]:
        """Held requests (direct_reads) vLLM finished whose push is over: vLLM
        frees their blocks now (``finished_sending``; each reported once,
        only after vLLM finished it: ``vllm/v1/core/sched/scheduler.py``
        frees a request's blocks at :3233-3235 and asserts it finished)."""
        if not self._held_finished:
            return set()
        loading = self.loader.loading() if self.loader is not None else set()
        with self._holds:
            sent = (self._held_finished & self._held_over) - loading
            self._holding -= sent
            self._held_over -= sent
            self._held_finished -= sent
        if sent:
            self.counters.add(holds_released=len(sent))
        return sent

    def _drop_holds(self, recving: set[str]) -> None:
        """Held requests vLLM finished while a load of theirs was still
        reported (aborted while waiting for remote KV): vLLM frees their
        blocks at that report (``scheduler.py:3226-3229``) and would fail
        an assert at a later ``finished_sending`` (:3233), so they are not
        reported sent (nor while their load is open: ``take_sent``)."""
        with self._holds:
            freed = recving & self._held_finished
            self._holding -= freed
            self._held_over -= freed
            self._held_finished -= freed

    def _wait_holds(self) -> None:
        """A step without tokens while only held requests remain: vLLM steps
        again at once (``vllm/v1/core/sched/scheduler.py:2813-2821`` keeps the
        engine busy while a finished request's blocks are held), about a
        thousand times a second; wait here for a push to end, at most
        ``IDLE_STEP_WAIT_S``, so the engine's core goes to the readers."""
        with self._holds:
            if not self._held_finished & self._held_over:
                self._holds.wait(IDLE_STEP_WAIT_S)

    def _push_over(self, req_id: str) -> None:
        """The sender: no read of ``req_id``'s blocks is asked any more."""
        with self._holds:
            if req_id in self._holding:
                self._held_over.add(req_id)
                self._holds.notify_all()

    def _forget(self, finished_req_ids: set[str]) -> None:
        if self.sender is not None and finished_req_ids:
            self.sender.finished(finished_req_ids)
        if self.shared is not None and finished_req_ids:
            self.shared.finished(finished_req_ids)
        for rid in finished_req_ids:
            self._drop_packing(rid)

    def shutdown(self) -> None:
        self.flush()
        if self._packer is not None:
            self._packer.shutdown(wait=True)
        if self.loader is not None:
            self.loader.close()
        if self.sender is not None:
            self.sender.close()
        if self.shared is not None:
            self.shared.close()
        if self.node is not None:
            self.node.close()
        if self.tier is not None:
            self.tier.close()
        path = getattr(self, "_endpoint_path", None)
        if path is not None:
            path.unlink(missing_ok=True)
