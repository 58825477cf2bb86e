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
    reuse: bool = True
    disk_path: str | None = None
    disk_gib: float = 16.0
    eviction: str = "lru"
    lookup_timeout_ms: int = 2000

    def __post_init__(self) -> None:
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_connector_extra_config.kv_port: {self.kv_port} is not a port")
        if self.store_slots < 0:
            raise ConfigError("kv_connector_extra_config.store_slots: must be >= 0")
        for name in ("chunk_tokens", "store_mib", "lease_ms", "pack_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_connector_extra_config.{name}: must be >= 1")
        if self.eviction != "lru":
            raise ConfigError(
                f"kv_connector_extra_config.eviction: {self.eviction!r}; only 'lru' is supported"
            )
        if self.lookup_timeout_ms < 1:
            raise ConfigError("kv_connector_extra_config.lookup_timeout_ms: must be >= 1")
        for name in ("load_timeout_s", "unknown_transfer_grace_s", "push_timeout_s", "disk_gib"):
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


_OPTIONAL_STR = ("ucx_net_devices", "disk_path")


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
