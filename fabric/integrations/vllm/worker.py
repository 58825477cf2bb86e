"""Worker side of the FabricConnector (runs in vLLM's worker process).

``register_kv_caches`` detects the layout and builds the chunk store, the
transfer node (a server on ``kv_port`` when this engine receives), the push
thread (prefiller) and the load thread (decoder). Per step:

- ``start_load_kv``: hand new LoadPlans to the load thread (asynchronous);
- ``wait_for_save``: pack the chunks this step completed into store slots
  (synchronous, memcpy speed) and hand them to the push thread;
- ``get_results``: requests whose load finished (and which of them failed).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from fabric.errors import CapacityError, ConfigError
from fabric.integrations.vllm.counters import FabricCounters
from fabric.integrations.vllm.loader import Loader
from fabric.integrations.vllm.sender import PushJob, PushSender
from fabric.kv import KVLayout, chunk_keys, pack
from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode, default_agent_name

if TYPE_CHECKING:
    import torch

    from fabric.integrations.vllm.config import ConnectorConfig
    from fabric.integrations.vllm.metadata import FabricMetadata, SaveChunk, SendPlan

logger = logging.getLogger(__name__)


class FabricWorker:
    """Owns the store, the transfer node and the push/load threads."""

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
    ) -> None:
        self.config, self.produce, self.consume = config, produce, consume
        self.block_size, self.model = block_size, model
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.counters = FabricCounters()
        self.layout: KVLayout | None = None
        self.node: TransferNode | None = None
        self.sender: PushSender | None = None
        self.loader: Loader | None = None
        self._keys: dict[str, list[bytes]] = {}

    # ------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = list(kv_caches.values())
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
        store = ChunkStore(StoreConfig(slot_bytes=slot_bytes, num_slots=num_slots))
        self.store = store
        self.node = TransferNode(
            store,
            self._transfer_config(),
            layout.fingerprint(),
            name=default_agent_name(f"fabric-{'d' if self.consume else 'p'}{self.tp_rank}"),
            serve=self.consume,
        )
        logger.info(
            "fabric: %s layout, %d layers, %d-token chunks of %.1f MiB, %d slots, %s%s",
            layout.kind.value,
            layout.num_layers,
            self.config.chunk_tokens,
            slot_bytes / 2**20,
            num_slots,
            self.node.plane.kind,
            f", serving on {self.node.endpoint}" if self.consume else "",
        )
        if self.produce:
            self.sender = PushSender(
                self.node.client,
                store,
                self.counters,
                lease_ms=self.config.lease_ms,
                push_timeout_s=self.config.push_timeout_s,
            )
        if self.consume:
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
            )

    def _transfer_config(self) -> TransferConfig:
        c = self.config
        port = c.kv_port + self.tp_rank if c.kv_port and self.consume else 0
        return TransferConfig(
            transport=c.transport,  # type: ignore[arg-type]
            host=c.host,
            port=port,
            lease_ms=c.lease_ms,
            nixl_progress_thread=c.nixl_progress_thread,
            ucx_net_devices=c.ucx_net_devices or os.environ.get("UCX_NET_DEVICES"),
        )

    # ------------------------------------------------------------ per step
    def start_load(self, meta: FabricMetadata) -> None:
        for plan in meta.loads:
            if self.loader is None:
                raise ConfigError("a LoadPlan reached a worker that does not consume KV")
            self.loader.submit(plan)

    def save(self, meta: FabricMetadata) -> None:
        for plan in meta.sends:
            self._begin(plan)
        for chunk in meta.saves:
            self._save_chunk(chunk)

    def _begin(self, plan: SendPlan) -> None:
        assert self.layout is not None and self.sender is not None
        keys = chunk_keys(plan.token_ids, self.config.chunk_tokens, self.layout.fingerprint())
        nbytes = [self.layout.chunk_nbytes(n) for n in plan.chunk_blocks]
        self._keys[plan.req_id] = keys
        self.sender.begin(PushJob(plan.req_id, plan.transfer_id, plan.endpoint, keys, nbytes))

    def _save_chunk(self, chunk: SaveChunk) -> None:
        assert self.layout is not None and self.sender is not None
        keys = self._keys.get(chunk.req_id)
        if keys is None:
            return
        key = keys[chunk.index]
        slots = self.store.acquire([key])  # packed before (same prefix): reuse it
        if not slots:
            try:
                slot = self.store.allocate(key)
            except CapacityError as exc:
                logger.warning(
                    "fabric: no slot to pack %s chunk %d: %s", chunk.req_id, chunk.index, exc
                )
                self.counters.add(push_failures=1)
                return
            view = self.store.pool.slot_view(slot)
            nbytes = pack(
                self.kv_caches,
                self.layout,
                chunk.block_ids,
                view,
                num_threads=self.config.pack_threads,
            )
            self.store.commit(slot, key, nbytes)
            slots = self.store.acquire([key])
        if slots:
            self.sender.chunk(chunk.req_id, chunk.index, slots[0])
        if chunk.index == len(keys) - 1:
            self._keys.pop(chunk.req_id, None)

    def get_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) since the last step."""
        if self.sender is not None and finished_req_ids:
            self.sender.finished(finished_req_ids)
            for rid in finished_req_ids:
                self._keys.pop(rid, None)
        if self.loader is None:
            return set(), set()
        return self.loader.take_results()

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self.sender is not None:
            self.sender.close()
        if self.node is not None:
            self.node.close()
