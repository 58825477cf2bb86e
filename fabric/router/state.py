"""What one proxy app holds: config, engines, policy, HTTP client, counters.

Kept on ``app.state.proxy``; nothing lives in module globals, so two proxies
can run in one process (tests do).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import httpx

from fabric.config import ProxyConfig
from fabric.router.engines import EnginePool
from fabric.router.policy import Routing
from fabric.router.transport import EngineHTTP, Timeouts, open_engines
from fabric.transfer.lookup import StoreClient

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    """Monotonic counters, exported on ``/metrics``.

    ``fallbacks``: requests decoded without remote KV (the prefill failed, P
    returned no ``kv_transfer_params``, or no prefiller was healthy), so the
    decoder computed the prompt itself. ``local_decodes``: requests sent
    straight to a decoder on purpose (prompt shorter than
    ``disaggregate_min_prompt_tokens``); not fallbacks. ``prefix_hits``:
    requests for which a cache-aware lookup found a prefix in some store.
    ``client_disconnects``: clients gone before their answer started (the
    work on P and D was cancelled). ``deadline_exceeded``: requests past
    ``proxy.request_deadline_s`` (504, or an error event ending the stream).
    """

    requests: int = 0
    client_errors: int = 0
    fallbacks: int = 0
    local_decodes: int = 0
    prefill_errors: int = 0
    decode_errors: int = 0
    prefix_hits: int = 0
    client_disconnects: int = 0
    deadline_exceeded: int = 0

    def as_dict(self) -> dict[str, int]:
        """Counter name -> value."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ProxyState:
    """State of one proxy app; the HTTP clients exist while the app runs."""

    def __init__(
        self,
        config: ProxyConfig,
        pool: EnginePool,
        policy: Routing,
        *,
        store_secret: str | None = None,
        shared_store: str | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.counters = Counters()
        self.store_clients: dict[str, StoreClient] = {}  # kv endpoint -> client
        self.store_secret = store_secret  # signs the store clients' frames (connector.secret_env)
        self.shared_store = shared_store  # the host's shared store (connector.shared_store)
        connect = config.connect_timeout_s
        self.prefill_timeouts = Timeouts(connect, config.prefill_timeout_s)
        self.decode_timeouts = Timeouts(connect, config.decode_timeout_s)
        self._client: httpx.AsyncClient | None = None
        self._engines: EngineHTTP | None = None

    @property
    def in_flight(self) -> int:
        """Requests routed and not yet answered (each holds its decoder from pick to end)."""
        return sum(e.outstanding for e in self.pool.decoders)

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared httpx client (probes, admin routes); only while the app runs."""
        if self._client is None:
            raise RuntimeError("the proxy's HTTP client is not open (app not started)")
        return self._client

    @property
    def engines(self) -> EngineHTTP:
        """The engine client of the PD flow (same pool as :attr:`client`)."""
        if self._engines is None:
            raise RuntimeError("the proxy's HTTP client is not open (app not started)")
        return self._engines

    def open_client(self) -> httpx.AsyncClient:
        """Open the clients, sized for ``max_connections`` per engine."""
        size = self.config.max_connections * max(1, len(self.pool.engines))
        timeout = httpx.Timeout(self.config.decode_timeout_s, connect=self.config.connect_timeout_s)
        self._engines, self._client = open_engines(
            self.config.http_pool, self.config.max_connections, size, timeout
        )
        if self._engines.pool_name != self.config.http_pool:
            logger.warning(
                "proxy.http_pool %s is not installed: using %s's (more CPU per request)",
                self.config.http_pool,
                self._engines.pool_name,
            )
        return self._client

    async def close_client(self) -> None:
        """Close the clients and the store clients."""
        for store in self.store_clients.values():
            store.close()
        self.store_clients.clear()
        if self._engines is not None:
            await self._engines.aclose()
            self._engines = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
