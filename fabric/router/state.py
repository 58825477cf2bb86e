"""What one proxy app holds: config, engines, policy, HTTP client, counters.

Kept on ``app.state.proxy``; nothing lives in module globals, so two proxies
can run in one process (tests do).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import httpx

from fabric.config import ProxyConfig
from fabric.router.engines import Engine, EnginePool
from fabric.router.policy import Routing
from fabric.router.transport import open_transport
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
    """State of one proxy app; the HTTP client exists while the app runs."""

    def __init__(
        self,
        config: ProxyConfig,
        pool: EnginePool,
        policy: Routing,
        *,
        store_secret: str | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.counters = Counters()
        self.store_clients: dict[str, StoreClient] = {}  # kv endpoint -> client
        self.store_secret = store_secret  # signs the store clients' frames (connector.secret_env)
        connect = config.connect_timeout_s
        self.prefill_timeout = httpx.Timeout(config.prefill_timeout_s, connect=connect)
        self.decode_timeout = httpx.Timeout(config.decode_timeout_s, connect=connect)
        self._prefill_extensions = {"timeout": self.prefill_timeout.as_dict()}
        self._decode_extensions = {"timeout": self.decode_timeout.as_dict()}
        self._client: httpx.AsyncClient | None = None
        self._transport: httpx.AsyncBaseTransport | None = None

    @property
    def in_flight(self) -> int:
        """Requests routed and not yet answered (each holds its decoder from pick to end)."""
        return sum(e.outstanding for e in self.pool.decoders)

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared client; only between app startup and shutdown."""
        if self._client is None:
            raise RuntimeError("the proxy's HTTP client is not open (app not started)")
        return self._client

    def open_client(self) -> httpx.AsyncClient:
        """Create the shared client, sized for ``max_connections`` per engine."""
        size = self.config.max_connections * max(1, len(self.pool.engines))
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        # NOTE: trust_env=False: engine traffic must never go through an
        # HTTP(S)_PROXY from the environment, and no .netrc lookups per request.
        transport = open_transport(size) if self.config.http_pool == "aiohttp" else None
        if transport is None and self.config.http_pool == "aiohttp":
            logger.warning("aiohttp is not installed: using httpx's pool (more CPU per request)")
        if transport is None:
            transport = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
        self._transport = transport
        self._client = httpx.AsyncClient(
            limits=limits, trust_env=False, timeout=self.decode_timeout, transport=transport
        )
        return self._client

    async def send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send an :meth:`engine_request`; the body is read unless ``stream``.

        NOTE: straight to the client's transport: ``AsyncClient.send`` adds
        auth, redirect, cookie-jar and event-hook handling that engine
        requests never use, and it cost ~40% of the proxy's CPU per request
        (cProfile, fake engines). Transports raise httpx's exceptions.
        """
        if self._transport is None:
            raise RuntimeError("the proxy's HTTP client is not open (app not started)")
        response = await self._transport.handle_async_request(request)
        response.request = request
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    def engine_request(
        self,
        engine: Engine,
        path: str,
        content: bytes,
        headers: dict[str, str],
        prefill: bool = False,
    ) -> httpx.Request:
        """A POST of ``content`` to ``engine``, with the prefill or decode timeouts.

        NOTE: built directly rather than by ``client.post``: the client's URL,
        header and cookie merging cost per request and add nothing here.
        """
        extensions = self._prefill_extensions if prefill else self._decode_extensions
        url = engine.url_for(path)
        return httpx.Request("POST", url, content=content, headers=headers, extensions=extensions)

    async def close_client(self) -> None:
        """Close the shared client and the store clients."""
        for store in self.store_clients.values():
            store.close()
        self.store_clients.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
            self._transport = None
