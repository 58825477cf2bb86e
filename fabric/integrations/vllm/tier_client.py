"""The scheduler's line to its workers' reuse tiers and the host's shared store.

These calls run inside vLLM's ``get_num_new_matched_tokens``, on the
engine's scheduler thread: while they wait, nothing is scheduled. So every
call is short and bounded.

The store lives in the worker process(es); the scheduler asks each TP
rank's control endpoint (``host:kv_port + rank``, or, with ``kv_port`` 0,
the endpoint the worker wrote to a file named after the engine id) how many
leading full chunks of a prompt it holds, holding them for the request. All
ranks are asked at once and polled until one deadline,
``lookup_timeout_ms`` from the first send (:func:`~fabric.transfer.lookup.lookup_all`),
so TP ranks cost one bound, not one each. The smallest hit wins: a rank
that holds less limits what every rank can load.

What a failure costs (:class:`Backoff`):

* A late answer (a rank busy or stalled past the bound,
  :class:`~fabric.transfer.lookup.ReplyTimeout`) is a miss for that request
  only: vLLM computes the prompt, the miss is counted (``lookup_timeouts``)
  and the next request asks again. Its answer, when it comes, is dropped by
  sequence number (see :mod:`fabric.transfer.lookup`).
* ``MAX_TIMEOUTS`` calls in a row with a late answer, or one hard failure
  (no connection: nothing listens at the endpoint; a refusal; a secret
  mismatch; no endpoint known yet), and the tier is not asked for
  ``BACKOFF_S``; the log says why (``Backoff.reason``), ``lookup_backoffs``
  counts it. After that one call probes it again: an answer resumes the
  tier, anything else backs off again at once, so a dead or hung rank costs
  at most one bound per ``BACKOFF_S``.

A hold the store made for a request whose answer came late is released by
the scheduler (a ``release`` in the next step's metadata, see
:mod:`fabric.integrations.vllm.scheduler`) or, failing that, ends with its
lease.

:class:`SharedTierClient` asks the host's shared store, on the same terms
and with the same bound, to fetch a prompt into this engine's store (rank
0's endpoint).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fabric.errors import FabricError, TransferError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.counters import FabricCounters
from fabric.kv.identity import BASE, KeyIdentity
from fabric.transfer import protocol as proto
from fabric.transfer.lookup import ReplyTimeout, StoreClient, lookup_all, resolve_endpoint

logger = logging.getLogger(__name__)

BACKOFF_S = 10.0
# NOTE: one late answer is load, not a dead peer; this many in a row is.
MAX_TIMEOUTS = 3


class Backoff:
    """When to stop asking a peer for a while, and why.

    ``failed`` skips the peer for ``backoff_s`` at once; ``timed_out`` only
    once ``max_timeouts`` calls in a row got no answer in time (the count
    is reset by an answer, not by the backoff: the probe after a backoff
    that times out again backs off again at once).
    """

    def __init__(
        self,
        what: str,
        counters: FabricCounters,
        *,
        backoff_s: float = BACKOFF_S,
        max_timeouts: int = MAX_TIMEOUTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.counters = what, counters
        self.backoff_s, self.max_timeouts, self._clock = backoff_s, max_timeouts, clock
        self.reason = ""  # why the peer was last skipped
        self._until = 0.0
        self._timeouts = 0

    def skipping(self) -> bool:
        return self._clock() < self._until

    def answered(self) -> None:
        self._timeouts = 0

    def timed_out(self, exc: FabricError, missed: int = 1) -> None:
        """A call (``missed`` answers of it) came too late: a miss for its request."""
        self.counters.add(lookup_timeouts=missed)
        self._timeouts += 1
        if self._timeouts >= self.max_timeouts:
            self.failed(f"{self._timeouts} calls in a row without an answer in time ({exc})")
        else:
            logger.debug(
                "fabric: %s answered too late (%s); a miss for this request", self.what, exc
            )

    def failed(self, reason: str) -> None:
        self.reason = reason
        self._until = self._clock() + self.backoff_s
        self.counters.add(lookup_backoffs=1)
        logger.warning(
            "fabric: %s: %s; computing prompts without it for %.0f s",
            self.what,
            reason,
            self.backoff_s,
        )


class WorkerTierClient:
    """``TierClient`` over the control channel of every TP rank (min hit wins)."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        tp_size: int,
        engine_id: str | None,
        counters: FabricCounters | None = None,
        backoff_s: float = BACKOFF_S,
    ) -> None:
        self.config, self.tp_size, self.engine_id = config, tp_size, engine_id
        self.counters = counters if counters is not None else FabricCounters()
        self.backoff = Backoff("the reuse tier", self.counters, backoff_s=backoff_s)
        self._clients: list[StoreClient] | None = None

    def lookup(self, request_id: str, token_ids: list[int], identity: KeyIdentity = BASE) -> int:
        if self.backoff.skipping():
            return 0
        clients = self._connect()
        if not clients:
            return 0
        results = lookup_all(
            clients,
            token_ids,
            hold=request_id,
            lease_ms=self.config.lease_ms,
            identity=identity,
            timeout_ms=self.config.lookup_timeout_ms,
        )
        return self._hit(results)

    def _hit(self, results: list[proto.LookupResult | FabricError]) -> int:
        """The hit every rank holds; counts and backs off on what went wrong."""
        late = [r for r in results if isinstance(r, ReplyTimeout)]
        failed = [
            r for r in results if isinstance(r, FabricError) and not isinstance(r, ReplyTimeout)
        ]
        if failed:
            self.backoff.failed(f"store lookup failed ({failed[0]})")
            self._drop_clients()  # NOTE: endpoints are resolved again after the backoff
            return 0
        if late:
            self.backoff.timed_out(late[0], len(late))
            return 0
        self.backoff.answered()
        return min(r.hit_chunks for r in results if isinstance(r, proto.LookupResult))

    def close(self) -> None:
        self._drop_clients()

    def endpoint(self) -> str | None:
        """Rank 0's control endpoint (where a shared store pushes fetched chunks)."""
        if self._clients:
            return self._clients[0].endpoint
        endpoints = self._endpoints()
        return endpoints[0] if endpoints else None

    def _drop_clients(self) -> None:
        for client in self._clients or []:
            client.close()
        self._clients = None

    def _connect(self) -> list[StoreClient]:
        if self._clients is None:
            endpoints = self._endpoints()
            if endpoints is None:
                self.backoff.failed(
                    f"no kv_port and no endpoint file from the workers of engine "
                    f"{self.engine_id} yet"
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

    Each fetch is one call bounded by ``lookup_timeout_ms``. A late answer
    is a miss for that request (``lookup_timeouts``); a hard failure (no
    connection, a refusal, no endpoint yet) is counted
    (``shared_store_failures``) and, like ``MAX_TIMEOUTS`` late answers in a
    row, skips the shared store for ``BACKOFF_S`` (:class:`Backoff`).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        worker: WorkerTierClient,
        counters: FabricCounters,
        *,
        backoff_s: float = BACKOFF_S,
    ) -> None:
        self.config, self.worker, self.counters = config, worker, counters
        self.backoff = Backoff("the shared store", counters, backoff_s=backoff_s)
        self._client: StoreClient | None = None

    def fetch(
        self,
        transfer_id: str,
        token_ids: list[int],
        min_chunks: int,
        identity: KeyIdentity = BASE,
    ) -> int:
        if self.backoff.skipping():
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
        except ReplyTimeout as exc:
            self.backoff.timed_out(exc)
            return 0
        except FabricError as exc:
            self.counters.add(shared_store_failures=1)
            self.backoff.failed(f"fetch failed ({exc})")
            return 0
        self.backoff.answered()
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
