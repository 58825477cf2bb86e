"""Which part of a topology runs on this machine, and what an engine takes from its host.

A topology with ``hosts:`` spans machines; ``fabric up --host NAME`` runs on
each of them and starts only what belongs there::

    the proxy's host          every other host
    ----------------          ----------------
    its own engines           its own engines
    its shared store          its shared store
    the proxy, which reaches  no proxy: the engines are supervised
    the other hosts' engines  (restarted with backoff) until a stop
    by their addresses, as    signal, and each drains on SIGTERM;
    running engines (url:     the proxy marks them down and up again
    http://ADDRESS:PORT)      by its own health probes

An engine started on a host listens on the host's ``bind`` (its address
by default) and advertises the host's ``address``: vLLM's ``--host`` and
``VLLM_HOST_IP``, the connector's ``host`` and ``advertise_host``. Its UCX
settings are the host's (``ucx_net_devices``, ``ucx_tls``), else those of
the environment ``fabric up`` runs in; with neither, none is set, so UCX
chooses among every device of the machine, unlike the single-host default
(``lo``: fabric's own processes talk over loopback).
Nothing is shared through a filesystem across hosts: each host's engines
find their host's shared store by its endpoint file in that host's
workdir, and the proxy reaches engines by URL.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

from fabric.config import LOCAL_HOST, EngineConfig, HostConfig, TopologyConfig
from fabric.errors import ConfigError, LaunchError


@dataclass(frozen=True)
class Placement:
    """What ``fabric up`` runs here.

    ``topology``: its engines are the ones to start here and, where the
    proxy runs here, every other host's engines as running ones (``url``);
    ``proxy``: whether the proxy runs here; ``host``: this machine's name
    (None: a single-host topology).
    """

    topology: TopologyConfig
    proxy: bool = True
    host: str | None = None

    @property
    def proxy_url(self) -> str | None:
        """Where the topology's proxy answers, when its port is fixed."""
        port = self.topology.proxy.port
        return None if port is None else f"http://{self.topology.proxy_address}:{port}"


def place(topology: TopologyConfig, host: str | None) -> Placement:
    """The part of ``topology`` that ``fabric up --host HOST`` runs (``host``
    None: all of it, which only a topology without ``hosts:`` allows)."""
    names = ", ".join(topology.hosts)
    if not topology.hosts:
        if host is not None:
            raise ConfigError(f"--host {host!r}: the topology has no hosts:")
        return Placement(topology)
    if host is None:
        raise ConfigError(
            f"hosts: the topology spans hosts ({names}): run fabric up --host NAME on each"
        )
    if host not in topology.hosts:
        raise ConfigError(f"--host {host!r}: none of hosts: ({names})")
    proxy = topology.proxy_host == host
    engines: dict[str, list[EngineConfig]] = {}
    for role in ("prefill", "decode"):
        kept = [_as_seen_from(topology, engine, host, proxy) for engine in getattr(topology, role)]
        engines[role] = [engine for engine in kept if engine is not None]
    return Placement(topology.model_copy(update=engines), proxy, host)


def _as_seen_from(
    topology: TopologyConfig, engine: EngineConfig, host: str, proxy: bool
) -> EngineConfig | None:
    """``engine`` as ``host`` runs it: as is when it runs here, a running
    engine when the proxy needs it, else None."""
    if engine.launched and topology.host_name(engine.host) == host:
        return engine
    if not proxy:
        return None
    if not engine.launched:
        return engine
    update = {"url": engine.base_url, "port": None, "model": None, "command": None}
    return engine.model_copy(update=update | {"host": None, "host_address": None})


def host_entry(topology: TopologyConfig, engine: EngineConfig) -> HostConfig | None:
    """The ``hosts:`` entry of the machine that runs ``engine`` (None: loopback)."""
    name = topology.host_name(engine.host)
    return None if name is None else topology.hosts[name]


def engine_bind(topology: TopologyConfig, engine: EngineConfig) -> str:
    """What ``engine``'s servers listen on: its host's ``bind``, else loopback."""
    entry = host_entry(topology, engine)
    return LOCAL_HOST if entry is None else entry.bind_host


def host_environment(entry: HostConfig | None, base: dict[str, str]) -> dict[str, str]:
    """``base`` (an engine's environment, whose ``UCX_NET_DEVICES`` the
    single-host default pins to ``lo``) with what its host sets: the
    advertised ``VLLM_HOST_IP``, the UCX devices and transports (the host's,
    else the operator's own from this environment, else unset), ``env``."""
    if entry is None or entry.loopback:
        return base
    env = dict(base)
    env["VLLM_HOST_IP"] = host_ip(entry.address)
    chosen = {"UCX_NET_DEVICES": entry.ucx_net_devices, "UCX_TLS": entry.ucx_tls}
    for name, value in chosen.items():
        value = value if value is not None else os.environ.get(name)
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env | entry.env


def host_ip(address: str) -> str:
    """``address`` as an IPv4 address (a name is resolved: ``VLLM_HOST_IP`` takes
    an address); ``LaunchError`` when it does not resolve."""
    try:
        return str(ipaddress.IPv4Address(address))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(address)
    except OSError as exc:
        raise LaunchError(f"hosts: {address!r} does not resolve here: {exc}") from exc
