"""The scheduler's line to its workers' reuse tiers.

The store lives in the worker process(es); the scheduler asks each TP
rank's control endpoint (``host:kv_port + rank``, or, with ``kv_port`` 0,
the endpoint the worker wrote to a file named after the engine id) how many leading
full chunks of a prompt it holds, holding them for the request. A rank that
does not answer within ``lookup_timeout_ms`` counts as a miss: vLLM computes
the prompt, nothing waits longer than that, and the tier is skipped for
``BACKOFF_S`` so a dead worker costs one timeout, not one per request.

:class:`SharedTierClient` asks the host's shared store, on the same terms,
to fetch a prompt into this engine's store (rank 0's endpoint).
"""

from __future__ import annotations

import logging
import time

from fabric.errors import FabricError, TransferError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import FabricCounters
from fabric.kv.identity import BASE, KeyIdentity
from fabric.transfer.lookup import StoreClient, resolve_endpoint

logger = logging.getLogger(__name__)

BACKOFF_S = 10.0


class WorkerTierClient:
    """``TierClient`` over the control channel of every TP rank (min hit wins)."""

    def __init__(self, config: ConnectorConfig, *, tp_size: int, engine_id: str | None) -> None:
        self.config, self.tp_size, self.engine_id = config, tp_size, engine_id
        self._clients: list[StoreClient] | None = None
        self._skip_until = 0.0

    def lookup(self, request_id: str, token_ids: list[int], identity: KeyIdentity = BASE) -> int:
        if time.monotonic() < self._skip_until:
            return 0
        clients = self._connect()
        if not clients:
            return 0
        hits = []
        try:
            for client in clients:
                result = client.lookup(
                    token_ids, hold=request_id, lease_ms=self.config.lease_ms, identity=identity
                )
                hits.append(result.hit_chunks)
        except FabricError as exc:
            self._skip_until = time.monotonic() + BACKOFF_S
            logger.warning(
                "fabric: store lookup failed (%s); computing prompts without the reuse "
                "tier for %.0f s",
                exc,
                BACKOFF_S,
            )
            return 0
        return min(hits)

    def close(self) -> None:
        for client in self._clients or []:
            client.close()

    def endpoint(self) -> str | None:
        """Rank 0's control endpoint (where a shared store pushes fetched chunks)."""
        endpoints = self._endpoints()
        return endpoints[0] if endpoints else None

    def _connect(self) -> list[StoreClient]:
        if self._clients is None:
            endpoints = self._endpoints()
            if endpoints is None:
                self._skip_until = time.monotonic() + BACKOFF_S
                logger.warning(
                    "fabric: no kv_port and no endpoint file from the workers of engine %s "
                    "yet; prompts are computed without the reuse tier for %.0f s",
                    self.engine_id,
                    BACKOFF_S,
                )
                return []
            timeout = self.config.lookup_timeout_ms
            secret = self.config.resolved_secret()
            self._clients = [StoreClient(e, timeout_ms=timeout, secret=secret) for e in endpoints]
        return self._clients

    def _endpoints(self) -> list[str] | None:
        c = self.config
        if c.kv_port:
            return [f"tcp://{c.host}:{c.kv_port + rank}" for rank in range(self.tp_size)]
        if self.engine_id is None:
            return None
        from fabric.integrations.vllm.worker import endpoint_file

        endpoints = []
        for rank in range(self.tp_size):
            endpoint = resolve_endpoint(str(endpoint_file(self.engine_id, rank)))
            if endpoint is None:
                return None
            endpoints.append(endpoint)
        return endpoints


class SharedTierClient:
    """``SharedTier`` over the shared store's control channel.

    Each fetch is one call bounded by ``lookup_timeout_ms``; a failure (no
    answer, a refusal, no endpoint yet) is counted and the shared store
    skipped for ``BACKOFF_S``.
    """

    def __init__(
        self, config: ConnectorConfig, worker: WorkerTierClient, counters: FabricCounters
    ) -> None:
        self.config, self.worker, self.counters = config, worker, counters
        self._client: StoreClient | None = None
        self._skip_until = 0.0

    def fetch(
        self,
        transfer_id: str,
        token_ids: list[int],
        min_chunks: int,
        identity: KeyIdentity = BASE,
    ) -> int:
        if time.monotonic() < self._skip_until:
            return 0
        try:
            client, own = self._connect()
            reply = client.fetch(
                transfer_id,
                token_ids,
                own,
                min_chunks=min_chunks,
                lease_ms=self.config.lease_ms,
                identity=identity,
            )
        except FabricError as exc:
            self._skip_until = time.monotonic() + BACKOFF_S
            self.counters.add(shared_store_failures=1)
            logger.warning(
                "fabric: shared store fetch failed (%s); not asking it for %.0f s", exc, BACKOFF_S
            )
            return 0
        return reply.hit_chunks if reply.pushing else 0

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def _connect(self) -> tuple[StoreClient, str]:
        own = self.worker.endpoint()
        endpoint = self.config.shared_store_endpoint()
        if own is None or endpoint is None:
            missing = "this engine's worker endpoint" if own is None else "its endpoint file"
            raise TransferError(f"shared store {self.config.shared_store}: {missing} not known yet")
        if self._client is None or self._client.endpoint != endpoint:
            self.close()
            self._client = StoreClient(
                endpoint,
                timeout_ms=self.config.lookup_timeout_ms,
                secret=self.config.resolved_secret(),
            )
        return self._client, own
