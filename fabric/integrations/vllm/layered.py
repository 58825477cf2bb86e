"""Pack a step's chunks while its forward pass still runs, a layer group at a time.

vLLM calls the connector's ``save_kv_layer`` after every attention layer of
the forward, once that layer wrote its KV for the step
(``vllm/model_executor/layers/attention/kv_transfer_utils.py:54-57``,
``maybe_transfer_kv_layer``: ``func`` -- which writes the layer's KV cache,
or follows ``unified_kv_cache_update`` that did,
``vllm/model_executor/layers/attention/attention.py:540-575`` -- then
``connector.save_kv_layer(layer_name, kv_cache, attn_metadata)``; applied
to ``unified_attention_with_output`` at ``attention.py:766``). A layer's KV
is not written again in the step: each attention layer writes only its own
cache. So once every layer of a group has been saved, the group's bytes of
every chunk the step completes are final and can be packed while the model
computes the next layers; ``wait_for_save`` then packs only the last group
and commits (:class:`~fabric.kv.layerwise.LayerwisePack`: the same bytes
and checksum as packing the chunk whole).

    forward thread (save_kv_layer)          pack thread (fabric-pack)
    (32 layers, layer_groups 8: fabric.kv.layerwise.group_ends)
    layer 0 .. 4 saved   --submit(5)-->     begin the step's pushes (their
                                            Reserves go out), take a slot
                                            per chunk, pack layers 0-4
                                            (layer_writes: hand each chunk's
                                            packed layers to the push threads,
                                            which write them to the decoder)
    layer 5 .. 9 saved   --submit(10)-->    pack layers 5-9 (and hand them over)
    ...                                     ...
    layer 29 .. 30 saved --submit(31)-->    pack layers 29-30 (and hand them over)
    wait_for_save        --submit(save)-->  pack layer 31, commit, hand
                                            the chunks to the push threads
                                            (which write the rest of each)

Groups shrink toward the end (5, 5, 5, 5, 5, 4, 2, 1 here): what is left
after the forward is what the decoder still waits for once the prefill
ended, and each earlier group is handled while the forward computes the
next, at least half its size.

The tokens of a chunk computed in earlier steps were written then (every
layer), and its blocks are held by the request, so they are final too.

A layer counts once every layer before it was saved in this step (in the
order of the engine's KV cache dict, which is the chunk's layer order),
whatever order the hooks come in, so hooks out of order cost overlap, never
an early read; names not in the dict are ignored. A speculative decoder's
draft layers come last in the dict (``vllm/v1/core/kv_cache_utils.py``)
and their hooks run while drafting, before ``wait_for_save`` (deferred
then): with several draft layers a group may end among them (the groups
shrinking toward the end, one does with two draft layers or more; one
draft layer is the last group alone) and be packed while a later draft
pass still writes positions past the prompt in its last block (which no
token of the chunk reads; a rewrite between a piece's copy and its hash
fails the chunk at use, recomputed), never loads wrong.
A chunk that got no slot during the forward, or whose layer-wise pack
failed, is packed whole at ``wait_for_save`` as without this; a slot
taken for a chunk that turns out to be present already is given back
then. A forward that raised is abandoned
(``FabricConnector.wait_for_save``). CPU caches with the C copy extension
only (:func:`fabric.kv.layerwise.supported`), no microbatching: on an
accelerator the forward is only enqueued when the hook runs.

A prefiller with ``direct_reads`` packs nothing for a pushed prompt its
decoder reads (the request is held): each group of such a chunk is hashed
in its blocks instead (:class:`~fabric.kv.layerwise.LayerwiseHash`, the same
streaming xxh3) and its leading layers offered (the group of each of the
request's chunks at once: one round trip to its decoder per group, as far
as the sender's batch limits allow), so the decoder READs them and unpacks
them while the forward computes the rest; ``wait_for_save``
hashes the last group and offers the chunk with its checksum
(``FabricWorker._offer_chunk``). Its other pushes are packed layer-wise as
above. The checksum covers every group, but a group is hashed and read
after the same hook: that its layers were written by then rests on the
hook order alone (pinned against vLLM's source in
``tests/integrations/test_vllm_hook_order.py``). With a speculative
decoder, a group that ends among the draft layers may be rewritten past
the prompt in its last block between its hash and its read: that chunk
fails at the decoder (recomputed), as a pack rewritten under its copy does.

Threads: :meth:`LayeredPacks.layer_packed` runs on the forward thread and
touches only the hook state (an exception there is caught by the worker,
never raised into the forward); :meth:`prepare`, :meth:`pack`,
:meth:`take` and :meth:`end` run on the pack thread (or inline without ``async_save``), one
job at a time, and :meth:`reset` on the forward thread once the pack thread
is idle (``before_step``, after the join).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fabric.errors import CapacityError
from fabric.kv.layerwise import LayerwiseHash, LayerwisePack, group_ends
from fabric.kv.layout import segment_table

if TYPE_CHECKING:
    import torch

    from fabric.integrations.vllm.counters import FabricCounters
    from fabric.integrations.vllm.metadata import FabricMetadata, PackChunk
    from fabric.kv import KVLayout
    from fabric.store import ChunkStore

logger = logging.getLogger(__name__)


class LayeredPacks:
    """Layer-wise packing of the chunks each step completes (see the module docstring)."""

    def __init__(
        self,
        store: ChunkStore,
        kv_caches: dict[str, torch.Tensor],
        layout: KVLayout,
        groups: int,
        counters: FabricCounters,
        on_part: Callable[[str, int, int, int, int], None] | None = None,
        on_drop: Callable[[str, int], None] | None = None,
        offered: Callable[[str], bool] | None = None,
        on_offer: Callable[[str, list[tuple[int, list[int], int]]], None] | None = None,
        on_cost: Callable[[str, float], None] | None = None,
    ) -> None:
        self.store = store
        self.on_part = on_part  # (req_id, index, slot, layers, bytes) packed so far
        self.on_drop = on_drop  # (req_id, index): that slot went back (after on_part)
        self.offered = offered  # whether a request's chunks are offered, not packed
        self.on_offer = on_offer  # (req_id, [(index, block_ids, layers) hashed so far])
        self.on_cost = on_cost  # (req_id, CPU seconds) spent packing or hashing its layers
        self.kv_caches = list(kv_caches.values())
        self.layout = layout
        self.counters = counters
        self._index = {name: i for i, name in enumerate(kv_caches)}
        # NOTE: where each layer's blocks are; vLLM registers its KV tensors once,
        # after allocating them (vllm/v1/worker/gpu_model_runner.py:7117-7119,
        # initialize_kv_cache; the CPU runner's calls it), and keeps them
        self._table = segment_table(self.kv_caches, layout)
        # NOTE: the last group is packed by wait_for_save
        self.ends = group_ends(layout.num_layers, groups)[:-1]
        # forward thread: the step whose hooks are being counted
        self._hook_meta: FabricMetadata | None = None
        self._saved: set[int] = set()
        self._upto = 0  # layers 0 .. _upto - 1 saved
        self._next = 0  # index in ends of the next group to hand over
        # pack thread: the step whose chunks have slots, and those slots
        self._meta: FabricMetadata | None = None
        self._parts: dict[tuple[str, int], tuple[int, LayerwisePack]] = {}
        self._hashes: dict[tuple[str, int], LayerwiseHash] = {}  # chunks offered

    def layer_packed(self, layer_name: str, meta: FabricMetadata) -> int | None:
        """``save_kv_layer(layer_name)`` of the step ``meta``: the number of
        layers to pack now when a group just became complete, else None."""
        if not self.ends or (not meta.packs and not meta.sends):
            return None
        index = self._index.get(layer_name)
        if index is None:
            return None
        if meta is not self._hook_meta:
            self._hook_meta, self._saved, self._upto, self._next = meta, set(), 0, 0
        self._saved.add(index)
        while self._upto in self._saved:
            self._upto += 1
        due = None
        while self._next < len(self.ends) and self.ends[self._next] <= self._upto:
            due = self.ends[self._next]
            self._next += 1
        return due

    def prepare(self, meta: FabricMetadata, key_of: Callable[[PackChunk], bytes | None]) -> None:
        """Take a slot for each chunk of ``meta`` that needs packing (``key_of``:
        its key, None when it is not to be saved); pack thread."""
        self.end()  # NOTE: a step that never reached wait_for_save gives its slots back
        self._meta = meta
        for chunk in meta.packs:
            if self.offered is not None and self.offered(chunk.req_id):
                self._hashes[(chunk.req_id, chunk.index)] = LayerwiseHash(
                    self.kv_caches, self.layout, chunk.block_ids, self._table
                )
                continue
            key = key_of(chunk)
            if key is None or (chunk.req_id, chunk.index) in self._parts:
                continue
            if self.store.contains(key):  # NOTE: nothing to pack
                continue
            try:
                slot = self.store.allocate(key)
            except CapacityError:
                continue  # NOTE: packed whole at wait_for_save, which says why it cannot be
            try:
                view = self.store.pool.slot_view(slot)
                part = LayerwisePack(self.kv_caches, self.layout, chunk.block_ids, view)
            except BaseException:
                self.store.abort(slot)
                raise
            self._parts[(chunk.req_id, chunk.index)] = (slot, part)

    def pack(self, meta: FabricMetadata, upto: int) -> None:
        """Pack layers up to ``upto`` of every chunk of ``meta`` with a slot; a
        chunk whose pack fails gives its slot back (packed whole later)."""
        if meta is not self._meta:
            return
        # NOTE: a request's chunks are offered together once its last one of
        # the step is hashed (a step lists each request's chunks together)
        for rid, hashes in itertools.groupby(list(self._hashes.items()), lambda kv: kv[0][0]):
            parts: list[tuple[int, list[int], int]] = []
            for key, hashing in hashes:
                if upto <= hashing.layers_done:
                    continue
                if not self._costed(key, "hashing", hashing.hash_layers, upto):
                    del self._hashes[key]  # NOTE: hashed whole and offered at wait_for_save
                    continue
                parts.append((key[1], hashing.block_ids, hashing.layers_done))
            if parts and self.on_offer is not None:
                self.on_offer(rid, parts)
        for key, (slot, part) in list(self._parts.items()):
            if not self._costed(key, "packing", part.pack_layers, upto):
                del self._parts[key]
                self._give_back(key, slot)
                continue
            if self.on_part is not None:
                self.on_part(key[0], key[1], slot, part.layers_done, part.bytes_done)

    def _costed(
        self, key: tuple[str, int], what: str, step: Callable[[int], None], upto: int
    ) -> bool:
        """``step(upto)`` for chunk ``key``, its CPU time told to ``on_cost``;
        False (logged and counted) when it raised."""
        cpu = time.thread_time()
        try:
            step(upto)
        except Exception:
            self.counters.add(thread_errors=1)
            logger.exception("fabric: %s layers of %s chunk %d failed", what, *key)
            return False
        finally:
            if self.on_cost is not None:
                self.on_cost(key[0], time.thread_time() - cpu)
        return True

    def take(self, chunk: PackChunk) -> tuple[int, LayerwisePack] | None:
        """The slot and pack begun for ``chunk`` (the caller finishes or aborts it)."""
        return self._parts.pop((chunk.req_id, chunk.index), None)

    def take_hash(self, chunk: PackChunk) -> LayerwiseHash | None:
        """The checksum begun for offered ``chunk`` (the caller finishes it)."""
        return self._hashes.pop((chunk.req_id, chunk.index), None)

    def end(self) -> None:
        """Give back the slots nobody took (chunks present meanwhile, requests
        that failed); pack thread, after a step's chunks were saved."""
        self._meta = None
        self._hashes = {}  # NOTE: chunks whose push ended before their final offer
        parts, self._parts = self._parts, {}
        for key, (slot, _) in parts.items():
            self._give_back(key, slot)

    def _give_back(self, key: tuple[str, int], slot: int) -> None:
        """Abort ``slot``; parts written from it are void (``on_drop``) first."""
        if self.on_part is not None and self.on_drop is not None:
            self.on_drop(*key)
        self.store.abort(slot)

    def reset(self) -> None:
        """Between steps, the pack thread idle: forget the hooks counted, give back slots."""
        self._hook_meta, self._saved, self._upto, self._next = None, set(), 0, 0
        self.end()

    def table_sizes(self) -> dict[str, int]:
        return {
            "worker_layered_slots": len(self._parts),
            "worker_layered_hashes": len(self._hashes),
        }
