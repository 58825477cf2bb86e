"""The scheduler's line to its workers' reuse tiers.

The store lives in the worker process(es); the scheduler asks each TP
rank's control endpoint (``host:kv_port + rank``, or, with ``kv_port`` 0,
the endpoint the worker wrote to a file named after the engine id) how many leading
full chunks of a prompt it holds, holding them for the request. A rank that
does not answer within ``lookup_timeout_ms`` counts as a miss: vLLM computes
the prompt, nothing waits longer than that, and the tier is skipped for
``BACKOFF_S`` so a dead worker costs one timeout, not one per request.
"""

from __future__ import annotations

import logging
import time

from fabric.errors import FabricError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.transfer.lookup import StoreClient

logger = logging.getLogger(__name__)

BACKOFF_S = 10.0


class WorkerTierClient:
    """``TierClient`` over the control channel of every TP rank (min hit wins)."""

    def __init__(self, config: ConnectorConfig, *, tp_size: int, engine_id: str | None) -> None:
        self.config, self.tp_size, self.engine_id = config, tp_size, engine_id
        self._clients: list[StoreClient] | None = None
        self._skip_until = 0.0

    def lookup(self, request_id: str, token_ids: list[int]) -> int:
        if time.monotonic() < self._skip_until:
            return 0
        clients = self._connect()
        if not clients:
            return 0
        hits = []
        try:
            for client in clients:
                result = client.lookup(token_ids, hold=request_id, lease_ms=self.config.lease_ms)
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
            try:
                endpoints.append(endpoint_file(self.engine_id, rank).read_text().strip())
            except OSError:
                return None
        return endpoints
