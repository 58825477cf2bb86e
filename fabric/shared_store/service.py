"""The shared store: one long-lived chunk store per host that engines attach to.

An engine's own store lives and dies with the engine. The shared store is a
process of its own (``fabric store serve``): engines push every full chunk
they compute into it, and a fresh engine -- another engine id, an empty
store -- fetches the prefixes it holds, so the tier outlives any one engine::

    engine A (worker)                 shared store                engine B (worker)
    -----------------                 ------------                -----------------
    Attach(fingerprint, chunk   ----> first one fixes the layout,
      tokens/bytes, endpoint)         others must match it
    Reserve / WRITE / notify    ====> slots filled, verified
                                      (disk write-behind)
                                      <---- Attach ------------------------
                                      <---- Fetch(tid, tokens, endpoint) --  (scheduler)
                                      Reserve / WRITE / notify ==========>  slots filled;
                                                                            the Loader
                                                                            unpacks tid

Geometry: the slot size is the chunk size of the first engine that
attaches (``Attach.chunk_bytes``), so an operator never has to compute KV
bytes per chunk. The memory (``mem_bytes``) is allocated and registered with
the data plane at start, as one region; at the first Attach it is carved
into slots of that size (:meth:`ChunkPool.carve`, same registration). Until
then Hellos and Fetches are refused. An engine whose fingerprint, chunk
tokens or chunk bytes differ is refused with ``layout_mismatch`` naming the
field; chunks are only ever pushed to engines that attached, so a Fetch can
never write a foreign layout into an engine.

Fetches are served off the control loop: an offload thread of the server
(:meth:`TransferServer.defer`) looks the prompt up and holds the hit chunks
(reading disk hits back in), and a fetch thread reserves, writes and waits
on the engine, bounded by ``push_timeout_s``. A failure is logged and
counted; the engine's Loader then times out and vLLM recomputes. A hold
ends when the fetch thread takes it, or by its lease; a push's reservation
here is released as soon as it is finished.

A Fetch carries no deadline of its requester (the scheduler waits only
``lookup_timeout_ms`` for the answer and then computes the prompt; that
bound stays on the engine), only the lease of what it asks for: a fetch
whose ``lease_ms`` ran out since it arrived here (it waited in the offload
queue, or its disk reads were slow) is not pushed (``fetch_expired``): its
hold is let go and the answer says ``pushing=False``. A fetch its
requester gave up on within its lease is still pushed; nobody loads it on
the engine, whose reservation then runs out its lease.

Counters (``ServiceCounters``) are counted under one lock: the loop, the
offload threads and the fetch thread all count.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from fabric.errors import ConfigError, FabricError, ProtocolError, ReservationRefused
from fabric.kv.identity import KeyIdentity
from fabric.settings import Settings
from fabric.store.chunk_store import ChunkStore
from fabric.store.disk import DiskTier
from fabric.store.pool import ChunkPool
from fabric.store.records import StoreConfig
from fabric.store.tier import TieredStore
from fabric.threads import thread as named_thread
from fabric.transfer import protocol as proto
from fabric.transfer.addresses import check_exposure
from fabric.transfer.client import TransferClient
from fabric.transfer.config import Port, TransferConfig, Transport, open_data_plane
from fabric.transfer.node import default_agent_name
from fabric.transfer.server import TransferServer
from fabric.transfer.store_client import write_endpoint

logger = logging.getLogger(__name__)

UNBOUND = "unbound"  # the fingerprint of a store no engine has attached to yet


class ServiceConfig(Settings):
    """What ``fabric store serve`` takes.

    ``mem_bytes``: the memory tier (all of it registered with the data plane
    at start). ``disk_path``/``disk_gib``: the optional disk tier, which
    survives restarts of the store. ``host``/``port``: the control channel
    (port 0 = a free one; ``endpoint_file`` receives it); ``advertise_host``:
    the address written there and told to peers (unset: ``host``, or one
    derived for a wildcard: :mod:`fabric.transfer.addresses`); ``insecure``:
    allow a ``host`` beyond loopback without a ``secret`` (refused otherwise). ``secret``: signs
    the control channel like the engines' (they need the same one).
    """

    mem_bytes: PositiveInt
    host: str = "127.0.0.1"
    port: Port = 0
    advertise_host: str | None = None
    insecure: bool = False
    transport: Transport = "auto"
    disk_path: str | None = None
    disk_gib: PositiveFloat = 16.0
    endpoint_file: str | None = None
    secret: str | None = Field(default=None, repr=False)
    lease_ms: PositiveInt = 30_000
    push_timeout_s: PositiveFloat = 30.0
    ucx_net_devices: str | None = None

    @model_validator(mode="after")
    def _exposure(self) -> ServiceConfig:
        check_exposure(self.host, self.secret, self.insecure, "host")
        return self

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(
            transport=self.transport,
            host=self.host,
            advertise_host=self.advertise_host,
            insecure=self.insecure,
            port=self.port,
            lease_ms=self.lease_ms,
            ucx_net_devices=self.ucx_net_devices or os.environ.get("UCX_NET_DEVICES"),
            secret=self.secret,
            idle_poll_interval_ms=IDLE_POLL_MS,
        )


IDLE_POLL_MS = 50.0
"""The store's receiver loop when nothing is outstanding, as an engine's: a
control message wakes it at once, and its idle tick only expires leases.
The store runs beside the host's engines; at the 5 ms default its loop woke
~194 times a second doing nothing (an idle NIXL receiver at 5 ms took ~18
ms of CPU a second on the dev VM, ~90 us a wake-up)."""

MAX_SLOTS = 1 << 20
"""The most slots a first Attach may carve the memory tier into (each is an object
here: a million take ~20 s and ~300 MB to build; a 2 MiB chunk of Llama-3-8B's 16
tokens still fills a 2 TiB tier)."""
MAX_CHUNK_TOKENS = 1 << 20


@dataclass(frozen=True)
class Geometry:
    """The chunk layout the store serves, fixed by the first Attach."""

    fingerprint: str
    chunk_tokens: int
    chunk_bytes: int

    def mismatch(self, msg: proto.Attach) -> str | None:
        """Why an engine's Attach does not fit, or None."""
        for name in ("fingerprint", "chunk_tokens", "chunk_bytes"):
            mine, theirs = getattr(self, name), getattr(msg, name)
            if mine != theirs:
                return (
                    f"{name}: engine has {theirs!r}, the shared store serves {mine!r} "
                    "(set by the first engine that attached)"
                )
        return None


@dataclass
class ServiceCounters:
    """Monotonic counters of the shared store (in ``Stats`` as ``service_*``)."""

    attaches: int = 0
    attach_refused: int = 0
    fetches: int = 0
    fetch_pushes: int = 0
    fetched_chunks: int = 0
    fetch_failures: int = 0
    fetch_expired: int = 0  # not pushed: its lease ran out before the push began


@dataclass(frozen=True)
class _FetchJob:
    transfer_id: str
    endpoint: str
    keys: list[bytes]
    lease_ms: int
    deadline: float  # time.monotonic() at which the Fetch's lease runs out


class SharedStore:
    """The shared store process's state: memory, disk, control channel, fetches."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.geometry: Geometry | None = None
        self.counters = ServiceCounters()
        self._counts = threading.Lock()
        self.tier: TieredStore | None = None
        self._attached: set[str] = set()
        # One slot spanning all the memory until the first Attach carves it.
        self._region = ChunkPool(1, config.mem_bytes)
        self.store = ChunkStore(StoreConfig(slot_bytes=config.mem_bytes, num_slots=1), self._region)
        self.disk = (
            DiskTier(config.disk_path, int(config.disk_gib * 2**30)) if config.disk_path else None
        )
        transfer = config.transfer_config()
        self.plane = open_data_plane(transfer, default_agent_name("fabric-store"))
        self._jobs: queue.Queue[_FetchJob | None] = queue.Queue()
        try:
            self.plane.register_pool(self._region.base_address, self._region.nbytes, "cpu")
            self.client = TransferClient(self.store, self.plane, transfer, UNBOUND)
            self.server = TransferServer(
                self.store,
                self.plane,
                transfer,
                UNBOUND,
                handlers={proto.Attach: self._attach_message, proto.Fetch: self._fetch_message},
                gate=self._gate,
                release_finished=True,  # NOTE: nobody reads a push into the shared store
            )
            self.server.extra_stats.append(
                lambda: {f"service_{k}": v for k, v in self.counter_values().items()}
            )
        except BaseException:
            self.plane.close()
            raise
        self._fetcher = named_thread(self._fetch_loop, name="fabric-fetch")

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def start(self) -> SharedStore:
        self.server.start()
        self._fetcher.start()
        if self.config.endpoint_file:
            write_endpoint(Path(self.config.endpoint_file), self.endpoint)
        return self

    def close(self) -> None:
        """Stop serving, finish the disk writes queued, release the data plane."""
        self.server.close()
        self._jobs.put(None)
        if self._fetcher.is_alive():
            self._fetcher.join(timeout=self.config.push_timeout_s + 5)
        self.client.close()
        if self.tier is not None:
            self.tier.close()  # NOTE: its writer drains what is queued first
        self.plane.close()
        if self.config.endpoint_file:
            Path(self.config.endpoint_file).unlink(missing_ok=True)

    def count(self, **deltas: int) -> None:
        """Add ``deltas`` to the counters (from any thread)."""
        with self._counts:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def counter_values(self) -> dict[str, int]:
        """A consistent copy of the counters."""
        with self._counts:
            return {k: int(v) for k, v in dataclasses.asdict(self.counters).items()}

    # ------------------------------------------------------------ control loop
    def _attach_message(self, identity: bytes, msg: proto.Message) -> proto.Message:
        assert isinstance(msg, proto.Attach)
        return self.on_attach(msg)

    def _fetch_message(self, identity: bytes, msg: proto.Message) -> proto.Message | None:
        assert isinstance(msg, proto.Fetch)
        # NOTE: its lookup reads disk hits back in: off the loop.
        fetch, received = msg, time.monotonic()
        return self.server.defer(identity, msg.seq, lambda: self.on_fetch(fetch, received))

    def _gate(self, msg: proto.Message) -> proto.Refused | None:
        """No Hello before the first Attach gave the store its layout."""
        if isinstance(msg, proto.Hello) and self.geometry is None:
            reason = "the shared store has no layout yet: an engine must Attach first"
            return proto.Refused(msg.seq, "", proto.Refusal.LAYOUT_MISMATCH, reason)
        return None

    def on_attach(self, msg: proto.Attach) -> proto.Message:
        """Fix the geometry on the first Attach; refuse engines that differ."""
        if self.geometry is None:
            try:
                self._bind(Geometry(msg.fingerprint, msg.chunk_tokens, msg.chunk_bytes))
            except ConfigError as exc:
                self.count(attach_refused=1)
                return proto.Refused(msg.seq, "", proto.Refusal.LAYOUT_MISMATCH, str(exc))
        assert self.geometry is not None
        why = self.geometry.mismatch(msg)
        if why is not None:
            self.count(attach_refused=1)
            logger.warning("refused engine at %s: %s", msg.endpoint, why)
            return proto.Refused(msg.seq, "", proto.Refusal.LAYOUT_MISMATCH, why)
        self.count(attaches=1)
        # NOTE: a restarted engine may come back on the same endpoint with a
        # new data plane; drop any link to its predecessor.
        self.client.disconnect(msg.endpoint)
        self._attached.add(msg.endpoint)
        logger.info("engine at %s attached", msg.endpoint)
        pool = self.store.pool
        return proto.Attached(msg.seq, pool.slot_bytes, pool.num_slots)

    def _bind(self, geometry: Geometry) -> None:
        """Carve the memory for ``geometry``; a :class:`ConfigError` for one
        outside sane bounds (the first Attach fixes it for every engine after,
        and needs no Hello: a chunk of a few bytes would make the store build
        millions of slots)."""
        if not 1 <= geometry.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ConfigError(
                f"chunk_tokens: {geometry.chunk_tokens} is outside 1..{MAX_CHUNK_TOKENS}"
            )
        if geometry.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes: must be >= 1, got {geometry.chunk_bytes}")
        slots = self._region.nbytes // geometry.chunk_bytes
        if slots > MAX_SLOTS:
            raise ConfigError(
                f"chunk_bytes: {geometry.chunk_bytes} would make {slots} slots of the "
                f"{self._region.nbytes}-byte memory tier (at most {MAX_SLOTS}): too small "
                "a chunk for this store (a larger chunk_tokens, or a smaller --mem-gib)"
            )
        if not geometry.fingerprint:
            raise ConfigError("fingerprint: must not be empty")
        pool = ChunkPool.carve(self._region, geometry.chunk_bytes)
        store = ChunkStore(StoreConfig(slot_bytes=pool.slot_bytes, num_slots=pool.num_slots), pool)
        tier = TieredStore(
            store,
            chunk_tokens=geometry.chunk_tokens,
            fingerprint=geometry.fingerprint,
            disk=self.disk,
        )
        # NOTE: runs on the server's loop thread before any Hello was accepted,
        # so no reservation, write or verification can see the old store.
        self.store, self.tier, self.geometry = store, tier, geometry
        self.server.store, self.server.tier = store, tier
        self.server.fingerprint = self.client.fingerprint = geometry.fingerprint
        self.client.store = store
        logger.info(
            "shared store bound: %d-token chunks of %.2f MiB, %d slots, layout %s",
            geometry.chunk_tokens,
            geometry.chunk_bytes / 2**20,
            pool.num_slots,
            geometry.fingerprint[:16],
        )

    def on_fetch(self, msg: proto.Fetch, received: float | None = None) -> proto.Message:
        """Hold the prompt's leading chunks; queue their push if there are
        enough and the Fetch's lease (from ``received``, when it arrived; now
        if None) has not run out meanwhile."""
        self.count(fetches=1)
        deadline = (time.monotonic() if received is None else received) + msg.lease_ms / 1000
        tier = self.tier
        if tier is None:
            return proto.Refused(
                msg.seq, msg.transfer_id, proto.Refusal.UNBOUND, "no engine attached yet"
            )
        if msg.endpoint not in self._attached:
            return proto.Refused(
                msg.seq, msg.transfer_id, "not_attached", f"{msg.endpoint} has not attached"
            )
        try:
            identity = KeyIdentity.decode(msg.identity)
        except ProtocolError as exc:
            return proto.Refused(msg.seq, msg.transfer_id, proto.Refusal.BAD_REQUEST, str(exc))
        hit = tier.lookup(
            msg.token_ids, hold=msg.transfer_id, lease_ms=msg.lease_ms, identity=identity
        )
        pushing = hit.chunks > msg.min_chunks and bool(hit.slots)
        if pushing and time.monotonic() >= deadline:
            self.count(fetch_expired=1)
            logger.info("fetch %s: its lease ran out before the push; not pushed", msg.transfer_id)
            pushing = False
        if pushing:
            keys = tier.keys(msg.token_ids, identity)[: hit.chunks]
            job = _FetchJob(msg.transfer_id, msg.endpoint, keys, msg.lease_ms, deadline)
            self._jobs.put(job)
        else:
            tier.release_hold(msg.transfer_id)
        return proto.Fetching(msg.seq, msg.transfer_id, tier.chunk_tokens, hit.chunks, pushing)

    # ------------------------------------------------------------ fetch thread
    def _fetch_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._push(job)
            except Exception:
                self.count(fetch_failures=1)
                logger.exception("fetch %s failed", job.transfer_id)

    def _push(self, job: _FetchJob) -> None:
        assert self.tier is not None
        slots = self.tier.take_hold(job.transfer_id)
        if slots is not None and time.monotonic() >= job.deadline:
            self.count(fetch_expired=1)
            logger.info("fetch %s: its lease ran out before the push; not pushed", job.transfer_id)
            self.store.release_slots(slots)
            return
        if slots is None or len(slots) < len(job.keys):
            self.count(fetch_failures=1)
            logger.warning("fetch %s: its chunks were let go before the push", job.transfer_id)
            if slots:
                self.store.release_slots(slots)
            return
        link = None
        try:
            link = self.client.connect(job.endpoint)
            res = link.push(
                job.transfer_id,
                job.keys,
                slots,
                timeout=self.config.push_timeout_s,
                lease_ms=job.lease_ms,
            )
        except FabricError as exc:
            self.count(fetch_failures=1)
            logger.warning("fetch %s to %s failed: %s", job.transfer_id, job.endpoint, exc)
            if not isinstance(exc, ReservationRefused):  # NOTE: a refusal is a live answer
                # NOTE: the engine may have restarted; handshake again next time.
                self.client.disconnect(job.endpoint)
            return
        finally:
            self.store.release_slots(slots)
        self.count(fetch_pushes=1, fetched_chunks=len(res.missing))


def serve(config: ServiceConfig, announce: Callable[[str], None] = print) -> int:
    """Run a shared store until SIGTERM or SIGINT; then stop it cleanly."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    service = SharedStore(config).start()
    try:
        disk = f", disk {config.disk_path}" if config.disk_path else ""
        announce(
            f"fabric store: serving on {service.endpoint} ({service.plane.kind}, "
            f"{config.mem_bytes / 2**30:.2f} GiB memory{disk})"
        )
        while not stop.wait(3600):
            pass
    finally:
        announce("fabric store: stopping")
        service.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
