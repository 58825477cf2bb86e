"""Bind one address, advertise a routable one.

A fabric server binds its control channel and TCP data plane to ``host``
and tells its peers where to reach them: the control endpoint it reports
(written to its endpoint file, returned by ``TransferServer.endpoint``) and
the TCP data plane's descriptor, which a sender receives in the Hello
answer and connects to. A wildcard bind (``0.0.0.0``) is not an address a
peer on another host can connect to (connecting to it reaches the peer's
own host), so the advertised host is, in order:

1. ``advertise_host`` when the operator set it;
2. the bind address itself when it is not a wildcard;
3. ``$VLLM_HOST_IP``, vLLM's own setting for "this node's IP", when set
   to an IPv4 address of this host (otherwise a warning, and the next);
4. the source address the kernel picks for a route to a public address
   (a UDP ``connect``: no packet is sent), when this host has such a route;
5. the first address of an interface that is up, running and not
   loopback (link-local aside);
6. ``127.0.0.1``, with a warning (nothing else was found: only peers on
   this host can reach it).

Steps 3-6 run once per process (the result is kept: every server of the
process advertises the same address).

IPv4 only: an IPv6 bind or advertised address is refused with a clear
error (the control channel's ZMQ sockets and the TCP data plane's
descriptor do not carry IPv6 yet).
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import logging
import os
import socket
import struct

from fabric.errors import ConfigError

logger = logging.getLogger(__name__)

WILDCARDS = frozenset({"0.0.0.0", "", "*"})
ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1: any default route reaches it; nothing is sent
HOST_IP_ENV = "VLLM_HOST_IP"
LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_IFF_RUNNING = 0x40
_UP_RUNNING = _IFF_UP | _IFF_RUNNING


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (not an address to connect to)."""
    return host.strip() in WILDCARDS


def bind_host(host: str) -> str:
    """``host`` as sockets and ZMQ bind it: ``0.0.0.0`` for any wildcard spelling."""
    return "0.0.0.0" if is_wildcard(host) else host.strip()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens only to this host (``127.x``, ``localhost``)."""
    value = host.strip()
    if value == "localhost":
        return True
    try:
        return ipaddress.ip_address(value.strip("[]")).is_loopback
    except ValueError:  # a wildcard or a name: reachable from elsewhere
        return False


def check_exposure(host: str, secret: str | None, insecure: bool, what: str) -> None:
    """Refuse to bind ``host`` beyond loopback without a secret, unless ``insecure``.

    Without a secret any process that reaches the port can reserve slots,
    write into them and read what the store holds; on loopback only this
    host's processes can.
    """
    if secret is not None or insecure or is_loopback(host):
        return
    raise ConfigError(
        f"{what}: {host!r} is reachable from other hosts and no secret is set: set a "
        "secret (every engine, store and proxy of the deployment the same one), or "
        "insecure: true to accept unauthenticated peers"
    )


def warn_if_insecure(host: str, secret: str | None, what: str) -> None:
    """Log loudly when ``host`` beyond loopback is served without a secret."""
    if secret is None and not is_loopback(host):
        logger.warning(
            "fabric: %s serves %r WITHOUT a secret (insecure): any host that reaches it can "
            "reserve, write and read KV",
            what,
            host,
        )


def local_host(bind: str) -> str:
    """Where a process on this host connects to a server bound to ``bind``."""
    return LOOPBACK if is_wildcard(bind) else bind.strip()


def check_host(host: str, what: str) -> str:
    """``host`` stripped, or a :class:`ConfigError` naming ``what`` for an IPv6 literal."""
    value = host.strip()
    try:
        version = ipaddress.ip_address(value.strip("[]")).version
    except ValueError:  # a name, resolved where it is used
        return value
    if version == 6:
        raise ConfigError(f"{what}: {host!r} is an IPv6 address; fabric speaks IPv4 only")
    return value


def advertised_host(bind: str, advertise: str | None = None) -> str:
    """The host peers should connect to for a server bound to ``bind`` (see the module)."""
    bind = check_host(bind, "host")
    if advertise is not None and advertise.strip():
        value = check_host(advertise, "advertise_host")
        if is_wildcard(value):
            raise ConfigError(f"advertise_host: {advertise!r} is a wildcard, not an address")
        return value
    if not is_wildcard(bind):
        return bind
    return _derived(os.environ.get(HOST_IP_ENV, "").strip())


@functools.lru_cache(maxsize=8)
def _derived(from_env: str) -> str:
    """The address a wildcard bind advertises, found once per process (and
    ``$VLLM_HOST_IP`` value): the same for every server, one warning."""
    if from_env:
        if is_local_ipv4(from_env):
            return from_env
        logger.warning(
            "fabric: %s=%r is not an IPv4 address of this host; ignored", HOST_IP_ENV, from_env
        )
    found = routed_address() or interface_address()
    if found is not None:
        return found
    logger.warning(
        "fabric: bound to every interface but found no address but loopback to advertise: "
        "peers on other hosts cannot reach this one (set advertise_host)"
    )
    return LOOPBACK


def is_local_ipv4(address: str) -> bool:
    """Whether ``address`` is an IPv4 address of an interface of this host."""
    try:
        if ipaddress.ip_address(address).version != 4:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
    except (ValueError, OSError):
        return False
    return True


def routed_address() -> str | None:
    """The source address of this host's route to a public address; None without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(ROUTE_PROBE)  # NOTE: UDP: picks a route, sends nothing
            address = str(probe.getsockname()[0])
    except OSError:  # no route (a host with no default route, an isolated namespace)
        return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def interface_address() -> str | None:
    """The IPv4 address of the first interface (by index) that is up, running
    and not loopback, link-local addresses (169.254/16) aside."""
    try:
        interfaces = socket.if_nameindex()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    with sock:
        for _, name in sorted(interfaces):
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(sock, _SIOCGIFFLAGS, request), 16)[0]
                if flags & _IFF_LOOPBACK or (flags & _UP_RUNNING) != _UP_RUNNING:
                    continue
                answer = fcntl.ioctl(sock, _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            address = socket.inet_ntoa(answer[20:24])
            if not address.startswith("169.254."):
                return address
    return None
