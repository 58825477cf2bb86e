"""FabricConnector settings, read from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fabric.errors import ConfigError
from fabric.transfer.addresses import advertised_host, check_exposure
from fabric.transfer.faults import FaultConfig
from fabric.transfer.store_client import resolve_endpoint


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``--kv-transfer-config '{"kv_connector_extra_config": {...}}'`` sets.

    ``kv_port``: where a decoding engine's fabric server binds (0 = free port,
    only useful when nobody needs to address it). ``chunk_tokens``: tokens per
    chunk, a multiple of vLLM's block size. ``store_mib``: the chunk pool.
    ``load_timeout_s``: how long a decoder waits for pushed KV before it
    recomputes. ``unknown_transfer_grace_s``: how long it waits for a transfer
    it has not heard of at all. ``waiting_hold_s``: how long it keeps a
    transfer pushed for a request still waiting in vLLM's queue (no blocks
    yet) alive past the transfer's lease, at most. ``pack_threads``: copy threads per pack.
    ``layer_groups``: with more than 1, the chunks a step completes are packed
    in that many groups of layers, each as soon as the forward pass has
    computed it, so only the last group is left to pack when the step ends
    (CPU KV caches, ``pack_threads`` 1; elsewhere packed at the step's end).
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

    kv_port: int = 0
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    insecure: bool = False
    transport: str = "auto"
    chunk_tokens: int = 256
    store_mib: int = 1024
    store_slots: int = 0
    lease_ms: int = 30_000
    load_timeout_s: float = 20.0
    unknown_transfer_grace_s: float = 2.0
    waiting_hold_s: float = 600.0
    push_timeout_s: float = 30.0
    pack_threads: int = 1
    layer_groups: int = 8
    async_save: bool = True
    nixl_progress_thread: bool = False
    ucx_net_devices: str | None = None
    reuse: bool = True
    model_revision: str | None = None
    disk_path: str | None = None
    disk_gib: float = 16.0
    eviction: str = "lru"
    lookup_timeout_ms: int = 2
    lookup_deadline_ms: int = 2000
    shared_store: str | None = None
    secret: str | None = field(default=None, repr=False)
    secret_env: str | None = None
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_connector_extra_config.kv_port: {self.kv_port} is not a port")
        if self.store_slots < 0:
            raise ConfigError("kv_connector_extra_config.store_slots: must be >= 0")
        for name in ("chunk_tokens", "store_mib", "lease_ms", "pack_threads", "layer_groups"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_connector_extra_config.{name}: must be >= 1")
        if self.eviction != "lru":
            raise ConfigError(
                f"kv_connector_extra_config.eviction: {self.eviction!r}; only 'lru' is supported"
            )
        if self.lookup_timeout_ms < 1:
            raise ConfigError("kv_connector_extra_config.lookup_timeout_ms: must be >= 1")
        if self.lookup_deadline_ms < self.lookup_timeout_ms:
            raise ConfigError(
                f"kv_connector_extra_config.lookup_deadline_ms: {self.lookup_deadline_ms} is "
                f"below lookup_timeout_ms {self.lookup_timeout_ms} (the deadline bounds a "
                "lookup over all the steps it waits; raise it with lookup_timeout_ms)"
            )
        for name in (
            "load_timeout_s",
            "unknown_transfer_grace_s",
            "waiting_hold_s",
            "push_timeout_s",
            "disk_gib",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv_connector_extra_config.{name}: must be > 0")
        self._check_secret()
        try:
            advertised_host(self.host, self.advertise_host)
            check_exposure(self.host, self.resolved_secret(), self.insecure, "host")
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config.{exc}") from exc
        if self.shared_store is not None:
            if not self.shared_store.strip():
                raise ConfigError("kv_connector_extra_config.shared_store: must not be empty")
            if not self.reuse:
                raise ConfigError(
                    "kv_connector_extra_config.shared_store: needs reuse (the shared "
                    "store is loaded through this engine's own store)"
                )

    def shared_store_endpoint(self) -> str | None:
        """The shared store's control endpoint: ``shared_store`` as a URL, or
        read from the endpoint file it names (None while that file is missing)."""
        return resolve_endpoint(self.shared_store)

    def _check_secret(self) -> None:
        if self.secret is not None and self.secret_env is not None:
            raise ConfigError("kv_connector_extra_config: give secret or secret_env, not both")
        if self.secret == "":
            raise ConfigError("kv_connector_extra_config.secret: must not be empty")
        if self.secret_env is not None and not os.environ.get(self.secret_env):
            raise ConfigError(
                f"kv_connector_extra_config.secret_env: environment variable "
                f"{self.secret_env!r} is not set (or empty)"
            )

    def resolved_secret(self) -> str | None:
        """The shared secret: ``secret``, or the variable ``secret_env`` names."""
        if self.secret_env is not None:
            return os.environ.get(self.secret_env) or None
        return self.secret

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Build from the extra-config dict; unknown keys are an error."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind: Any = type(known[name].default)
            if name == "faults":
                values[name] = value if isinstance(value, FaultConfig) else _faults(value)
                continue
            if name in _OPTIONAL_STR:
                kind = str
            try:
                if kind is bool:
                    values[name] = _as_bool(value)
                    continue
                values[name] = value if value is None or kind is type(None) else kind(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"kv_connector_extra_config.{name}: {exc}") from exc
        return cls(**values)


_OPTIONAL_STR = (
    "advertise_host",
    "ucx_net_devices",
    "disk_path",
    "shared_store",
    "secret",
    "secret_env",
    "model_revision",
)


def _faults(value: Any) -> FaultConfig:
    try:
        return FaultConfig.from_dict(value)
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"kv_connector_extra_config.{exc}") from exc


def _as_bool(value: Any) -> bool:
    """JSON booleans, 0/1, and the strings true/false/yes/no/on/off."""
    if isinstance(value, bool | int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.strip().lower()]
    raise ValueError(f"{value!r} is not a boolean")


_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True} | {
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}


def endpoint_file(engine_id: str, rank: int) -> Path:
    """Where a worker whose ``kv_port`` is 0 (a free port) leaves its control
    endpoint for the scheduler of the same engine (another process)."""
    safe = "".join(c for c in engine_id if c.isalnum() or c in "-_")[:64]
    return Path(tempfile.gettempdir()) / f"fabric-{safe}-tp{rank}.endpoint"
