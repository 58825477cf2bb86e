"""FabricConnector settings, read from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from fabric.settings import Settings
from fabric.transfer.addresses import advertised_host, check_exposure
from fabric.transfer.faults import FaultConfig
from fabric.transfer.store_client import resolve_endpoint


class ConnectorConfig(Settings):
    """What ``--kv-transfer-config '{"kv_connector_extra_config": {...}}'`` sets.

    ``kv_port``: where a decoding engine's fabric server binds (0 = free port,
    only useful when nobody needs to address it). ``chunk_tokens``: tokens per
    chunk, a multiple of vLLM's block size. ``store_mib``: the chunk pool.
    ``pool_device``: where the chunk pool lives: ``auto`` (VRAM on the KV
    cache's GPU, where chunks are packed by the fused kernels and hashed with
    fold64 on the device; pinned host memory instead where the pool must be
    host memory: the tcp transport, a shared store; the host for a CPU
    cache), ``host`` (host memory, pinned for a cache on a GPU), ``cuda``
    (VRAM, or an error), ``pinned`` or ``cpu``. Engines that exchange chunks
    must agree on host memory or VRAM (a Hello across the two is refused:
    their chunk checksums differ). A VRAM pool takes ``store_mib`` of GPU
    memory beyond vLLM's ``gpu_memory_utilization``.
    ``load_timeout_s``: how long a decoder waits for pushed KV before it
    recomputes. ``unknown_transfer_grace_s``: how long it waits for a transfer
    it has not heard of at all. ``waiting_hold_s``: how long it keeps a
    transfer pushed for a request still waiting in vLLM's queue (no blocks
    yet) alive past the transfer's lease, at most. ``pack_threads``: copy threads per pack.
    ``layer_groups``: with more than 1, the chunks a step completes are packed
    in that many groups of layers, each as soon as the forward pass has
    computed it, so only the last group is left to pack when the step ends;
    groups shrink toward the end (``fabric.kv.layerwise.group_ends``: 32
    layers in 8 leave one layer to the end) (CPU KV caches, ``pack_threads``
    1; elsewhere packed at the step's end).
    ``layer_writes``: a prefiller also writes each group it packed during the
    forward to its decoder at once (the decoder unpacks it as it lands), so
    only the last group is left to write and unpack after the step; off: a
    chunk is written once packed whole.
    ``direct_reads`` (a prefiller): its decoders READ each computed chunk
    straight out of its KV cache into their own store, instead of it
    packing the chunk and writing it; it only hashes the chunk in place, so
    the copies run on the decoder's cores, not the prefill's. vLLM keeps a
    finished request's blocks until every chunk was read (or its push
    failed). Needs the ``nixl`` transport (or ``loopback``) and a KV cache
    in host memory, and registers the whole KV cache with the data plane.
    The cache's registration (NIXL partial metadata) goes only in Offers,
    to a decoder that answered this engine's Hello and granted a Reserve
    (both signed beyond loopback), never in the descriptor every Hello
    carries; such a decoder can READ and WRITE the cache, and the decoders
    this engine pushes to are named by requests' ``kv_transfer_params``:
    sign the control channel beyond loopback, and on one host enable it
    only where just the proxy reaches this engine's API. Chunks of pushed
    prompts are then not packed into this engine's own store (no reuse
    here, nothing saved to the shared store from them); with layer groups
    each group is hashed and offered as the forward writes it. ``auto``:
    per decoder link, the path each push takes is chosen by what the two
    cost on that link (:mod:`fabric.integrations.vllm.paths`: the
    prefiller's fabric CPU per MiB, and the time from the last chunk to
    the push's end), measured on the pushes themselves; a decoder that
    does not read offers (or that no Offer may reach), the tcp transport
    or a KV cache on a GPU here gets staged pushes only. vLLM keeps the
    blocks of every pushed prompt then, given back once a staged push's
    last chunk is packed.
    ``local_reads``: on one host (same boot, PID and network namespace), a
    decoder reads a prefiller's cache in place rather than through UCX, and
    a prefiller with ``direct_reads`` moves the inside pages of its KV cache
    onto a sealed memory file (when vLLM registers the cache, before any
    forward; the cache's addresses stay the same, its memory shows as
    shared memory), which such a decoder maps read-only and copies from
    (:mod:`fabric.transfer.local_read`). Off where ``UCX_TLS`` leaves out
    UCX's same-host copies (e.g. ``tcp``).
    ``async_save``: pack computed chunks on a thread of their own while the
    engine does its between-step work, joined before the next forward (off:
    inside ``wait_for_save``, as the step ends).
    ``host``: where the fabric server (control channel and TCP data plane)
    binds; ``advertise_host``: the address its peers are told to connect to
    (unset: ``host``, or for a wildcard ``host`` such as ``0.0.0.0``,
    ``$VLLM_HOST_IP``, else this host's routed or first non-loopback
    address: :mod:`fabric.transfer.addresses`). ``model_revision``: names
    the weights in chunk keys instead of the digest of the model's weight
    files (for weights the engine does not read as local files; see
    :mod:`fabric.integrations.vllm.identity`).
    ``lookup_timeout_ms``: how long vLLM's scheduler waits, per scheduler
    step and for all the requests it asks in that step together, for its
    workers' reuse tiers (all TP ranks at once) and the shared store, inside
    ``get_num_new_matched_tokens``, while the engine schedules nothing. A
    request not answered by then is skipped for this step and asked again in
    the next ones (no wait), until ``lookup_deadline_ms`` from its first ask:
    only then is it a miss (the prompt is computed). So a slow answer (a hold
    reading disk-tier hits in before the worker answers) costs the request a
    step or a few, not its hit, and the engine the ``lookup_timeout_ms`` poll
    per step (an ask that runs past it, e.g. on a busy machine, is counted:
    ``scheduler_wait_overruns``). ``lookup_deadline_ms`` must be >= ``lookup_timeout_ms``.

    ``insecure``: allow a ``host`` beyond loopback without a secret (refused
    otherwise; logged loudly).

    ``secret`` signs the control channel and notifications (HMAC-SHA256);
    ``secret_env`` names an environment variable to read it from instead, so
    it stays off command lines. Every engine (and the proxy) of a deployment
    needs the same secret. ``faults``: fault injection for tests, a dict of
    :class:`~fabric.transfer.faults.FaultConfig` fields, e.g.
    ``{"corrupt": 1.0}``; off by default.
    """

    model_config = ConfigDict(coerce_numbers_to_str=True)
    SECTION: ClassVar[str] = "kv_connector_extra_config"

    kv_port: int = Field(default=0, ge=0, le=65535)
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    insecure: bool = False
    transport: Literal["auto", "nixl", "tcp", "loopback"] = "auto"
    chunk_tokens: PositiveInt = 256
    store_mib: PositiveInt = 1024
    store_slots: NonNegativeInt = 0
    pool_device: Literal["auto", "host", "cuda", "pinned", "cpu"] = "auto"
    lease_ms: PositiveInt = 30_000
    load_timeout_s: PositiveFloat = 20.0
    unknown_transfer_grace_s: PositiveFloat = 2.0
    waiting_hold_s: PositiveFloat = 600.0
    push_timeout_s: PositiveFloat = 30.0
    pack_threads: PositiveInt = 1
    layer_groups: PositiveInt = 8
    layer_writes: bool = True
    direct_reads: bool | Literal["auto"] = False
    async_save: bool = True
    nixl_progress_thread: bool = False
    ucx_net_devices: str | None = None
    local_reads: bool = True
    reuse: bool = True
    model_revision: str | None = None
    disk_path: str | None = None
    disk_gib: PositiveFloat = 16.0
    eviction: Literal["lru"] = "lru"
    lookup_timeout_ms: PositiveInt = 2
    lookup_deadline_ms: PositiveInt = 2000
    shared_store: str | None = None
    secret: str | None = Field(default=None, repr=False)
    secret_env: str | None = None
    faults: FaultConfig = Field(default_factory=FaultConfig)

    @field_validator("faults", mode="before")
    @classmethod
    def _faults(cls, value: Any) -> Any:
        if value is None:
            return FaultConfig()
        if not isinstance(value, FaultConfig | Mapping):
            raise ValueError(f"expected a mapping, got {type(value).__name__}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ConnectorConfig:
        if self.lookup_deadline_ms < self.lookup_timeout_ms:
            raise ValueError(
                f"lookup_deadline_ms: {self.lookup_deadline_ms} is below lookup_timeout_ms "
                f"{self.lookup_timeout_ms} (the deadline bounds a lookup over all the steps it "
                "waits; raise it with lookup_timeout_ms)"
            )
        self._check_secret()
        if self.direct_reads is True and self.transport == "tcp":
            raise ValueError(
                "direct_reads: the tcp transport cannot read a peer's memory; use nixl "
                "(or auto where nixl is installed)"
            )
        advertised_host(self.host, self.advertise_host)
        check_exposure(self.host, self.resolved_secret(), self.insecure, "host")
        if self.pool_device == "cuda" and self.transport in ("tcp", "loopback"):
            raise ValueError(
                f"pool_device: 'cuda' with the {self.transport} transport, which moves host "
                "memory only; use nixl (or auto where nixl is installed)"
            )
        if self.pool_device == "cuda" and self.shared_store is not None:
            raise ValueError(
                "pool_device: 'cuda' with a shared_store, which keeps chunks in host memory; "
                "use auto, host or pinned"
            )
        if self.shared_store is not None:
            if not self.shared_store.strip():
                raise ValueError("shared_store: must not be empty")
            if not self.reuse:
                raise ValueError(
                    "shared_store: needs reuse (the shared store is loaded through this "
                    "engine's own store)"
                )
        return self

    def shared_store_endpoint(self) -> str | None:
        """The shared store's control endpoint: ``shared_store`` as a URL, or
        read from the endpoint file it names (None while that file is missing)."""
        return resolve_endpoint(self.shared_store)

    def _check_secret(self) -> None:
        if self.secret is not None and self.secret_env is not None:
            raise ValueError("give secret or secret_env, not both")
        if self.secret == "":
            raise ValueError("secret: must not be empty")
        if self.secret_env is not None and not os.environ.get(self.secret_env):
            raise ValueError(
                f"secret_env: environment variable {self.secret_env!r} is not set (or empty)"
            )

    def resolved_secret(self) -> str | None:
        """The shared secret: ``secret``, or the variable ``secret_env`` names."""
        if self.secret_env is not None:
            return os.environ.get(self.secret_env) or None
        return self.secret

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Build from the extra-config dict; unknown keys are an error."""
        return cls(**dict(extra or {}))

    @classmethod
    def check_extra(cls, extra: dict[str, Any]) -> None:
        """ConfigError unless the engine's connector will accept ``extra``, as
        far as a launcher can tell before the engine runs: every check but the
        secret's (its variable is set in the engine's environment, not here)
        and the exposure check that needs it."""
        probe = {k: v for k, v in extra.items() if k not in ("secret", "secret_env")}
        cls.from_extra(probe | {"insecure": True})


def endpoint_file(engine_id: str, rank: int) -> Path:
    """Where a worker whose ``kv_port`` is 0 (a free port) leaves its control
    endpoint for the scheduler of the same engine (another process)."""
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:64]
    return Path(tempfile.gettempdir()) / f"fabric-{safe}-tp{rank}.endpoint"
