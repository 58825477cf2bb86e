"""Transfer configuration and data-plane construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fabric.errors import ConfigError

if TYPE_CHECKING:
    from fabric.transfer.dataplane import DataPlane

Transport = Literal["auto", "nixl", "tcp", "loopback"]


@dataclass(frozen=True)
class TransferConfig:
    """Settings shared by the sending and receiving ends.

    ``transport``: ``auto`` picks NIXL when it imports, else TCP.
    ``host``/``port``: where the receiver's control channel binds (port 0 =
    a free port chosen by the OS). ``poll_interval_ms``: how often the
    receiver checks for notifications while writes are outstanding;
    ``idle_poll_interval_ms`` when none are. ``nixl_progress_thread``: NIXL's
    busy-polling progress thread (off: see ``benchmarks/transfer.py``).
    ``ucx_net_devices``: sets ``UCX_NET_DEVICES`` before NIXL starts (``lo``
    for single-host tests; None leaves UCX's choice).
    """

    transport: Transport = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = 1 << 20
    control_timeout_ms: int = 5000
    lease_ms: int = 10000
    poll_interval_ms: float = 0.2
    idle_poll_interval_ms: float = 5.0
    expire_interval_ms: float = 50.0
    nixl_progress_thread: bool = False
    ucx_net_devices: str | None = None

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "nixl", "tcp", "loopback"):
            raise ConfigError(f"transfer.transport: unknown transport {self.transport!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"transfer.port: {self.port} is not a port number")
        for name in ("max_message_bytes", "control_timeout_ms", "lease_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"transfer.{name}: must be positive")
        for name in ("poll_interval_ms", "idle_poll_interval_ms", "expire_interval_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"transfer.{name}: must be positive")

    def resolved_transport(self) -> str:
        """The concrete transport ``auto`` stands for on this machine."""
        if self.transport != "auto":
            return self.transport
        from fabric.transfer.nixl_plane import nixl_available

        return "nixl" if nixl_available() else "tcp"


def open_data_plane(config: TransferConfig, name: str) -> DataPlane:
    """Build the data plane ``config`` asks for; the caller registers its pool."""
    transport = config.resolved_transport()
    if transport == "nixl":
        from fabric.transfer.nixl_plane import NixlDataPlane

        return NixlDataPlane(
            name,
            progress_thread=config.nixl_progress_thread,
            ucx_net_devices=config.ucx_net_devices,
        )
    if transport == "tcp":
        from fabric.transfer.tcp_plane import TcpDataPlane

        return TcpDataPlane(name, host=config.host)
    from fabric.transfer.dataplane import LoopbackDataPlane

    return LoopbackDataPlane(name)
