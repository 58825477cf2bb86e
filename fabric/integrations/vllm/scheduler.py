"""Scheduler side of the FabricConnector (runs in vLLM's EngineCore).

Prefiller (request carries ``do_remote_decode``): every step, chunks whose
tokens are all computed once the step has run become ``SaveChunk``s; the
worker packs them at the end of that step and pushes them while the rest of
the prompt is still computing. Nothing holds vLLM's blocks past the step
that computed them, so ``request_finished`` never delays a free.

    prompt:   | chunk 0 | chunk 1 | chunk 2 |c3|    (chunk_tokens each)
    step 1:   [ computed ][....]                  -> save chunk 0
    step 2:             [ computed.............]  -> save chunks 1, 2, 3

Decoder (request carries ``do_remote_prefill`` + ``transfer_id``): every
prompt token beyond the local prefix hit is reported as loadable
asynchronously; once vLLM allocated the blocks a ``LoadPlan`` tells the
worker where to unpack. vLLM recomputes the last prompt token itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from fabric.errors import ConfigError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.metadata import FabricMetadata, LoadPlan, SaveChunk, SendPlan

logger = logging.getLogger(__name__)


class RequestLike(Protocol):
    request_id: str
    prompt_token_ids: list[int] | None
    kv_transfer_params: dict[str, Any] | None


def chunk_block_counts(num_tokens: int, chunk_tokens: int, block_size: int) -> list[int]:
    """Blocks each chunk of a ``num_tokens`` prompt covers (the last may be short)."""
    counts = []
    for start in range(0, num_tokens, chunk_tokens):
        tokens = min(chunk_tokens, num_tokens - start)
        counts.append(-(-tokens // block_size))
    return counts


@dataclass
class _Sending:
    req_id: str
    transfer_id: str
    endpoint: str
    token_ids: list[int]
    chunk_blocks: list[int]
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0
    announced: bool = False


@dataclass
class _Receiving:
    transfer_id: str
    num_tokens: int
    num_local_tokens: int


class FabricScheduler:
    """Per-request bookkeeping for pushes (prefiller) and loads (decoder)."""

    def __init__(
        self, config: ConnectorConfig, block_size: int, *, produce: bool, consume: bool
    ) -> None:
        if config.chunk_tokens % block_size:
            raise ConfigError(
                f"kv_connector_extra_config.chunk_tokens: {config.chunk_tokens} is not a "
                f"multiple of vLLM's block size {block_size}"
            )
        self.config, self.block_size = config, block_size
        self.produce, self.consume = produce, consume
        self._sending: dict[str, _Sending] = {}
        self._receiving: dict[str, _Receiving] = {}
        self._loads: list[LoadPlan] = []
        # NOTE: a failed load makes vLLM reschedule the request from scratch,
        # asking again; one load attempt per request, then it computes.
        self._attempted: set[str] = set()

    # ------------------------------------------------------------ decoder
    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not (self.consume and params.get("do_remote_prefill")):
            return 0, False
        if request.request_id in self._attempted:
            return 0, False
        transfer_id = params.get("transfer_id")
        num_tokens = len(request.prompt_token_ids or [])
        if not isinstance(transfer_id, str) or params.get("num_tokens") != num_tokens:
            logger.warning(
                "request %s: kv_transfer_params %s do not describe this prompt of %d "
                "tokens; computing it locally",
                request.request_id,
                params,
                num_tokens,
            )
            return 0, False
        if num_computed_tokens >= num_tokens:
            return 0, False
        self._receiving[request.request_id] = _Receiving(
            transfer_id, num_tokens, num_computed_tokens
        )
        return num_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        recv = self._receiving.pop(rid, None)
        if recv is not None and num_external_tokens > 0:
            self._attempted.add(rid)
            first = recv.num_local_tokens // self.block_size
            last = -(-(recv.num_local_tokens + num_external_tokens) // self.block_size)
            self._loads.append(
                LoadPlan(rid, recv.transfer_id, first, list(block_ids[first:last]), recv.num_tokens)
            )
        params = request.kv_transfer_params or {}
        if self.produce and params.get("do_remote_decode") and rid not in self._sending:
            self._track_send(request, params)

    def _track_send(self, request: RequestLike, params: dict[str, Any]) -> None:
        transfer_id, endpoint = params.get("transfer_id"), params.get("decode_kv_endpoint")
        if not isinstance(transfer_id, str) or not isinstance(endpoint, str):
            logger.warning(
                "request %s: do_remote_decode without transfer_id/decode_kv_endpoint; "
                "nothing will be pushed",
                request.request_id,
            )
            return
        tokens = list(request.prompt_token_ids or [])
        counts = chunk_block_counts(len(tokens), self.config.chunk_tokens, self.block_size)
        self._sending[request.request_id] = _Sending(
            request.request_id, transfer_id, endpoint, tokens, counts
        )

    # ------------------------------------------------------------ every step
    def build_connector_meta(self, scheduler_output: Any) -> FabricMetadata:
        meta = FabricMetadata(loads=self._loads)
        self._loads = []
        num_scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            send = self._sending.get(new.req_id)
            if send is not None:
                send.block_ids = list(new.block_ids[0])
                computed = new.num_computed_tokens + num_scheduled.get(new.req_id, 0)
                self._emit(send, computed, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            send = self._sending.get(rid)
            if send is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids:
                    send.block_ids = list(new_ids[0])  # preempted: a fresh block list
                else:
                    send.block_ids += new_ids[0]
            computed = cached.num_computed_tokens[i] + num_scheduled.get(rid, 0)
            self._emit(send, computed, meta)
        return meta

    def _emit(self, send: _Sending, computed: int, meta: FabricMetadata) -> None:
        if not send.announced:
            meta.sends.append(
                SendPlan(
                    send.req_id,
                    send.transfer_id,
                    send.endpoint,
                    send.token_ids,
                    send.chunk_blocks,
                )
            )
            send.announced = True
        done = min(computed, len(send.token_ids))
        chunk_tokens = self.config.chunk_tokens
        chunk_blocks = chunk_tokens // self.block_size
        while send.next_chunk < len(send.chunk_blocks):
            index = send.next_chunk
            if min((index + 1) * chunk_tokens, len(send.token_ids)) > done:
                return
            start = index * chunk_blocks
            block_ids = send.block_ids[start : start + send.chunk_blocks[index]]
            if len(block_ids) < send.chunk_blocks[index]:
                return  # blocks not allocated yet (cannot happen once computed)
            meta.saves.append(SaveChunk(send.req_id, index, block_ids))
            send.next_chunk += 1

    # ------------------------------------------------------------ finish
    def request_finished(self, request: RequestLike) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` for the response (prefiller), or None."""
        rid = request.request_id
        self._receiving.pop(rid, None)
        self._attempted.discard(rid)
        send = self._sending.pop(rid, None)
        if send is None:
            return None
        if send.next_chunk < len(send.chunk_blocks):
            logger.warning(
                "request %s finished after %d of %d chunks; the decoder will compute it",
                rid,
                send.next_chunk,
                len(send.chunk_blocks),
            )
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": send.transfer_id,
            "num_tokens": len(send.token_ids),
            "chunk_tokens": self.config.chunk_tokens,
        }
