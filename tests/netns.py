"""Simulated hosts: network namespaces on one bridge, for tests of fabric across hosts.

    with Hosts(["hostp", "hostd"]) as hosts:
        hosts.address("hostd")             # "10.77.0.3"
        hosts.command("hostd", [...])      # argv that runs inside hostd's namespace
        hosts.cut("hostd")                 # a partition: hostd's packets dropped
        hosts.cap("hostp", "1gbit")        # what hostp sends, capped (tc tbf)

Each host is a namespace with ``lo`` up and one veth, ``eth0``, holding
``10.77.0.N/24`` (N = 2, 3, ... in the order given). The other end of each
veth sits on a bridge in a namespace of its own (the "switch"), so no
address is added outside the namespaces made here, and there is no default
route: a host reaches only the others. Every namespace (and with it every
veth and the bridge) is deleted on exit. Namespace names carry this
process's pid, so concurrent runs do not collide.

Needs root (``ip netns``); :func:`skip_reason` says why not, and
:func:`hosts_or_skip` skips the test with it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
from collections.abc import Iterator, Sequence
from types import TracebackType

import pytest

SUBNET = "10.77.0"
_counter = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    probe = f"fabprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    except subprocess.CalledProcessError as exc:
        return f"cannot create network namespaces: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def hosts_or_skip(names: Sequence[str]) -> Iterator[Hosts]:
    """:class:`Hosts` for a fixture, or ``pytest.skip`` saying why they cannot be made."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with Hosts(names) as made:
        yield made


class Hosts:
    """Namespaces ``names`` on one bridge; a context manager (see the module docstring)."""

    def __init__(self, names: Sequence[str]) -> None:
        if not 1 <= len(names) <= 200 or len(set(names)) != len(names):
            raise ValueError(f"host names must be 1..200 distinct names: {names}")
        tag = f"fab{os.getpid()}x{next(_counter)}"
        self.switch = f"{tag}-sw"
        self.namespaces = {name: f"{tag}-{name}" for name in names}
        self.addresses = {name: f"{SUBNET}.{i + 2}" for i, name in enumerate(names)}
        self._made: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.namespaces.items()):
            _ip("netns", "add", ns)
            self._made.append(ns)
            port = f"p{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def address(self, name: str) -> str:
        """The host's address on the bridge."""
        return self.addresses[name]

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the host's namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespaces[name], *argv]

    def cut(self, name: str, cut: bool = True) -> None:
        """Partition the host from the others (its bridge port down: its eth0
        loses carrier, packets to and from it are dropped, no RST nor ICMP
        reaches a peer), or (``cut=False``) heal it."""
        port = f"p{list(self.namespaces).index(name)}"
        _ip("-n", self.switch, "link", "set", port, "down" if cut else "up")

    def cap(self, name: str, rate: str | None) -> None:
        """Cap what the host sends at ``rate`` (``tc``'s token bucket, e.g.
        ``"1gbit"``), or (None) lift the cap."""
        ns = self.namespaces[name]
        if rate is None:
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                capture_output=True,
                timeout=30,
            )
            return
        tc = ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate]
        tc = ["ip", "netns", "exec", ns, *tc, "burst", "256kb", "latency", "100ms"]
        subprocess.run(tc, check=True, capture_output=True, timeout=30)

    def close(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them)."""
        while self._made:
            ns = self._made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
