"""FabricConnector settings, read from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from fabric.errors import ConfigError


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``--kv-transfer-config '{"kv_connector_extra_config": {...}}'`` sets.

    ``kv_port``: where a decoding engine's fabric server binds (0 = free port,
    only useful when nobody needs to address it). ``chunk_tokens``: tokens per
    chunk, a multiple of vLLM's block size. ``store_mib``: the chunk pool.
    ``load_timeout_s``: how long a decoder waits for pushed KV before it
    recomputes. ``unknown_transfer_grace_s``: how long it waits for a transfer
    it has not heard of at all. ``pack_threads``: copy threads per pack.
    """

    kv_port: int = 0
    host: str = "127.0.0.1"
    transport: str = "auto"
    chunk_tokens: int = 256
    store_mib: int = 1024
    store_slots: int = 0
    lease_ms: int = 30_000
    load_timeout_s: float = 20.0
    unknown_transfer_grace_s: float = 2.0
    push_timeout_s: float = 30.0
    pack_threads: int = 1
    nixl_progress_thread: bool = False
    ucx_net_devices: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_connector_extra_config.kv_port: {self.kv_port} is not a port")
        if self.store_slots < 0:
            raise ConfigError("kv_connector_extra_config.store_slots: must be >= 0")
        for name in ("chunk_tokens", "store_mib", "lease_ms", "pack_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_connector_extra_config.{name}: must be >= 1")
        for name in ("load_timeout_s", "unknown_transfer_grace_s", "push_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv_connector_extra_config.{name}: must be > 0")

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
            try:
                values[name] = value if value is None or kind is type(None) else kind(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"kv_connector_extra_config.{name}: {exc}") from exc
        return cls(**values)
