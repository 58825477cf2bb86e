"""Worker side of the host's shared store (``shared_store``): attach, then push to it.

At start the worker attaches (tells the store its layout fingerprint, chunk
geometry and its own control endpoint: the store fetches only into engines
that attached). Then every full chunk the engine computes and packs into its
own store is also pushed to the shared store by a :class:`PushSender` of its
own, off the model step: one Reserve per request (the store answers which
chunks it already has, so a prefix pushed by any engine before is not
written again), one WRITE per chunk as it is packed.

A shared store that does not answer or fails a write costs the push thread
one bounded call; the failure is counted (``shared_store_failures``, as is
every push skipped meanwhile) and the store skipped for 1 s, doubling up to
``BACKOFF_S`` (a refusal is an answer, not a failure). A store that refuses
this engine's layout is logged as an error once and never asked again. The
worker attaches again every ``REATTACH_S`` before a push, so a store that
restarted on the same endpoint serves it again. Requests never wait for any
of it.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

from fabric.errors import LayoutMismatch, TransferError
from fabric.integrations.vllm.sender import SHARED_STORE_COUNTERS, PushJob, PushSender
from fabric.transfer.store_client import DEFAULT_TIMEOUT_MS, StoreClient

if TYPE_CHECKING:
    from fabric.integrations.vllm.config import ConnectorConfig
    from fabric.integrations.vllm.counters import FabricCounters
    from fabric.store import ChunkStore
    from fabric.transfer import TransferClient

logger = logging.getLogger(__name__)

BACKOFF_S = 10.0
REATTACH_S = 10.0


class SharedSaver:
    """Attaches this worker to the shared store and pushes its computed chunks."""

    def __init__(
        self,
        config: ConnectorConfig,
        client: TransferClient,
        store: ChunkStore,
        counters: FabricCounters,
        *,
        fingerprint: str,
        chunk_bytes: int,
        own_endpoint: str,
    ) -> None:
        self.config, self.store, self.counters = config, store, counters
        self.fingerprint, self.chunk_bytes = fingerprint, chunk_bytes
        self.own_endpoint = own_endpoint
        self._attached: str | None = None
        self._attached_at = 0.0
        self.refused = False
        self.sender = PushSender(
            client,
            store,
            counters,
            lease_ms=config.lease_ms,
            push_timeout_s=config.push_timeout_s,
            names=SHARED_STORE_COUNTERS,
            prepare=self._attach,
            backoff_s=BACKOFF_S,
            name="fabric-shared-push",
        )
        endpoint = config.shared_store_endpoint()
        try:
            self._attach(endpoint)
        except TransferError as exc:
            self.counters.add(shared_store_failures=1)
            logger.warning("fabric: cannot attach to the shared store yet (%s); will retry", exc)

    def begin(self, req_id: str, keys: list[bytes]) -> None:
        """A request whose full chunks ``keys`` will be packed (model thread)."""
        endpoint = self.config.shared_store_endpoint()
        if self.refused or endpoint is None or not keys:
            return
        transfer_id = f"save-{uuid.uuid4().hex}"
        nbytes = [self.chunk_bytes] * len(keys)
        self.sender.begin(PushJob(req_id, transfer_id, endpoint, keys, nbytes))

    def chunk(self, req_id: str, index: int, slot: int) -> None:
        """Chunk ``index`` is packed in ``slot``; the caller's ref passes to us."""
        self.sender.chunk(req_id, index, slot)

    def finished(self, req_ids: set[str]) -> None:
        self.sender.finished(req_ids)

    def close(self) -> None:
        self.sender.close()

    def _attach(self, endpoint: str | None) -> None:
        """Attach (push thread, or at start), again every ``REATTACH_S``: a
        store restarted on the same endpoint starts empty and unattached
        (Attach is idempotent); raises TransferError."""
        if endpoint is None:
            raise TransferError(f"shared store endpoint file {self.config.shared_store} is missing")
        now = time.monotonic()
        if self._attached == endpoint and now - self._attached_at < REATTACH_S:
            return
        if self.refused:
            raise TransferError("the shared store refused this engine's layout")
        # NOTE: off vLLM's scheduler loop: the control channel's usual bound,
        # not the scheduler's per-step lookup poll (lookup_timeout_ms)
        client = StoreClient(
            endpoint,
            timeout_ms=max(self.config.lookup_timeout_ms, DEFAULT_TIMEOUT_MS),
            secret=self.config.resolved_secret(),
        )
        try:
            reply = client.attach(
                self.fingerprint, self.config.chunk_tokens, self.chunk_bytes, self.own_endpoint
            )
        except LayoutMismatch as exc:
            self.refused = True
            logger.error("fabric: the shared store refused this engine: %s; not using it", exc)
            raise TransferError(str(exc)) from exc
        finally:
            client.close()
        again, self._attached, self._attached_at = self._attached == endpoint, endpoint, now
        if again:
            return
        logger.info(
            "fabric: attached to the shared store at %s (%d slots of %.1f MiB)",
            endpoint,
            reply.num_slots,
            reply.slot_bytes / 2**20,
        )
