"""Transfer configuration and data-plane construction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from fabric.settings import Settings
from fabric.transfer.addresses import advertised_host, check_exposure, check_host
from fabric.transfer.faults import FaultConfig
from fabric.transfer.protocol import MAX_LEASE_MS, Codec

if TYPE_CHECKING:
    from fabric.transfer.dataplane import DataPlane

Transport = Literal["auto", "nixl", "tcp", "loopback"]
Port = Annotated[int, Field(ge=0, le=65535)]


class TransferConfig(Settings):
    """Settings shared by the sending and receiving ends.

    ``transport``: ``auto`` picks NIXL when it imports, else TCP.
    ``host``/``port``: where the receiver's control channel (and the TCP
    data plane) binds (port 0 = a free port chosen by the OS);
    ``advertise_host``: the address peers are told to connect to (None: the
    bind address, or for a wildcard bind one derived as
    :mod:`fabric.transfer.addresses` says). ``poll_interval_ms``: how often the
    receiver checks for notifications while writes are outstanding and
    something came within the last ``server.QUIET_AFTER_MS`` (a
    notification or a control message); ``quiet_poll_interval_ms`` while
    writes are outstanding and nothing came for that long (a reservation
    made at dispatch waits a whole prefill for its first chunk);
    ``idle_poll_interval_ms`` when none are outstanding (a control message
    wakes it at once). ``peer_idle_s``: a receiver forgets a sender (and
    unloads its data-plane metadata) after this long without a control
    message from it; a sender that comes back is asked to say Hello again,
    which its link does by itself. ``nixl_progress_thread``: NIXL's
    busy-polling progress thread (off: see ``benchmarks/transfer.py``).
    ``ucx_net_devices``: sets ``UCX_NET_DEVICES`` before NIXL starts (``lo``
    for single-host tests; None leaves UCX's choice). ``local_reads``: a
    NIXL plane reads a peer of this host (same boot, PID and network
    namespace) in place, out of the memory it shares, rather than through
    UCX, and shares the regions it registers (:mod:`fabric.transfer.local_read`);
    off where ``UCX_TLS`` leaves out UCX's own same-host copies.

    ``write_timeout_ms``: the longest a posted write lives; a sender aborts
    one still running after it (:class:`~fabric.transfer.client.PendingPush`).
    A receiver's ``StoreConfig.quarantine_ms`` must be at least the longest
    write timeout of its senders (their defaults agree: 30 s and 35 s); a
    NIXL receiver whose quarantine is shorter than its own setting warns.

    ``insecure``: allow a ``host`` beyond loopback (a wildcard, an
    interface's address) without a ``secret`` (refused otherwise: anyone who
    reaches the port could reserve, write and read KV; logged loudly).

    ``secret``: a shared secret; when set, every control frame and
    notification is signed (HMAC-SHA256) and unsigned or wrongly signed ones
    are refused (see :mod:`fabric.transfer.protocol`). Every sender,
    receiver and store client of a deployment needs the same one; it never
    appears in ``repr``. ``max_message_bytes`` bounds every frame, enforced
    by ZMQ on receipt and by the codec on both ends. ``faults``: fault
    injection for tests (:mod:`fabric.transfer.faults`), off by default.
    """

    SECTION: ClassVar[str] = "transfer"

    transport: Transport = "auto"
    host: str = "127.0.0.1"
    port: Port = 0
    advertise_host: str | None = None
    insecure: bool = False
    max_message_bytes: PositiveInt = 1 << 20
    control_timeout_ms: PositiveInt = 5000
    lease_ms: Annotated[int, Field(gt=0, le=MAX_LEASE_MS)] = 10000
    write_timeout_ms: PositiveInt = 30_000
    poll_interval_ms: PositiveFloat = 0.2
    quiet_poll_interval_ms: PositiveFloat = 1.0
    idle_poll_interval_ms: PositiveFloat = 5.0
    expire_interval_ms: PositiveFloat = 50.0
    peer_idle_s: PositiveFloat = 900.0
    nixl_progress_thread: bool = False
    ucx_net_devices: str | None = None
    local_reads: bool = True
    secret: Annotated[str, Field(min_length=1)] | None = Field(default=None, repr=False)
    faults: FaultConfig = Field(default_factory=FaultConfig)

    @model_validator(mode="after")
    def _consistent(self) -> TransferConfig:
        check_host(self.host, "transfer.host")
        if self.advertise_host is not None:
            advertised_host(self.host, self.advertise_host)  # refuses a wildcard or IPv6
        if self.quiet_poll_interval_ms < self.poll_interval_ms:
            raise ValueError(
                f"quiet_poll_interval_ms: {self.quiet_poll_interval_ms} is below "
                f"poll_interval_ms ({self.poll_interval_ms}): the quiet poll is the slower one"
            )
        check_exposure(self.host, self.secret, self.insecure, "transfer.host")
        return self

    def codec(self) -> Codec:
        """The frame codec of this side: its secret and size limit."""
        return Codec(self.secret, self.max_message_bytes)

    def advertised(self) -> str:
        """The host this side's peers connect to (``addresses.advertised_host``)."""
        return advertised_host(self.host, self.advertise_host)

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
            local_reads=config.local_reads,
        )
    if transport == "tcp":
        from fabric.transfer.tcp_plane import TcpDataPlane

        return TcpDataPlane(
            name, host=config.host, secret=config.secret, advertise_host=config.advertised()
        )
    from fabric.transfer.dataplane import LoopbackDataPlane

    return LoopbackDataPlane(name)
