"""Transfers between simulated hosts (network namespaces), and what a server advertises.

A receiver bound to every interface (``host: 0.0.0.0``) must tell its
senders an address they can reach: its TCP data plane used to advertise the
bind address, so a sender on another host connected to 0.0.0.0 -- itself --
and every push failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.errors import ConfigError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.shared_store.service import ServiceConfig
from fabric.transfer import TransferConfig
from fabric.transfer.addresses import advertised_host, interface_address, is_wildcard
from fabric.transfer.nixl_plane import nixl_available
from tests.netns import Hosts, hosts_or_skip

from .test_two_processes import Peer

HERE = Path(__file__).parent
PUSHER_SCRIPT = HERE / "pusher.py"
SLOT_BYTES = 1 << 20
CHUNKS = 6
PROCESS_TIMEOUT_S = 120

TRANSPORTS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl")),
    "tcp",
]
# NOTE: across namespaces of one kernel UCX would pick its shared-memory
# transports; TCP over the veths is what a second host would use.
UCX_ENV = {"UCX_TLS": "tcp"}


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with hosts_or_skip(["hostp", "hostd"]) as made:
        yield made


def _env() -> dict[str, str]:
    """This process's environment, less what would pick the advertised address."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_HOST_IP"}


def _python_in(hosts: Hosts, name: str, code: str, env: dict[str, str] | None = None) -> str:
    argv = hosts.command(name, [sys.executable, "-c", code])
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        env=_env() | (env or {}),
        cwd=HERE.parent.parent,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _receiver(hosts: Hosts, name: str, transport: str, bind: str) -> Peer:
    """tests/transfer/peer.py inside a host's namespace, bound to ``bind``."""
    devices = "eth0" if transport == "nixl" else "-"
    return Peer(
        transport,
        wrap=lambda argv: hosts.command(name, argv),
        extra=[bind, devices],
        env=_env() | UCX_ENV,
    )


def _push(hosts: Hosts, name: str, transport: str, endpoint: str, request: str, seed: int) -> dict:
    devices = "eth0" if transport == "nixl" else "-"
    argv = [sys.executable, str(PUSHER_SCRIPT), transport, endpoint, request, str(seed)]
    done = subprocess.run(
        hosts.command(name, [*argv, str(CHUNKS), str(SLOT_BYTES), devices]),
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        env=_env() | UCX_ENV,
        cwd=HERE.parent.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receiver_bound_to_every_interface_is_pushed_to_from_another_host(
    hosts: Hosts, transport: str
) -> None:
    receiver = _receiver(hosts, "hostd", transport, "0.0.0.0")
    try:
        address = hosts.address("hostd")
        port = receiver.endpoint.rsplit(":", 1)[1]
        assert receiver.endpoint == f"tcp://{address}:{port}"
        # NOTE: the sender names the receiver as a topology does: its host's
        # address and its port (not the endpoint it reports).
        pushed = _push(hosts, "hostp", transport, f"tcp://{address}:{port}", "req-x", 7)
        assert pushed == {"ok": True, "nbytes": CHUNKS * SLOT_BYTES}, pushed
        seen = receiver.cmd("wait", "req-x", 30, 7)
        assert seen["complete"] and seen["filled"] == CHUNKS, seen
        assert seen["bad"] == [] and seen["failed"] == [], seen
        assert receiver.cmd("stats")["reserved"] == 0
    finally:
        receiver.stop()


def test_a_wildcard_bind_advertises_the_hosts_address(hosts: Hosts) -> None:
    code = (
        "from fabric.transfer.addresses import advertised_host as a;"
        "print(a('0.0.0.0'), a('*'), a('0.0.0.0', '10.9.8.7'), a('10.77.0.3'))"
    )
    # No default route in a namespace: the interface's address.
    assert _python_in(hosts, "hostd", code).split() == [hosts.address("hostd")] * 2 + [
        "10.9.8.7",
        "10.77.0.3",
    ]
    # vLLM's node address wins over what the interfaces say, if it is one of this host's.
    subprocess.run(
        ["ip", "-n", hosts.namespaces["hostp"], "addr", "add", "10.77.0.102/24", "dev", "eth0"],
        check=True,
        timeout=30,
    )
    first = _python_in(hosts, "hostp", code, {"VLLM_HOST_IP": "10.77.0.102"}).split()[0]
    assert first == "10.77.0.102"
    # ... and is ignored (with a warning) when it is not
    first = _python_in(hosts, "hostp", code, {"VLLM_HOST_IP": "10.1.2.3"}).split()[0]
    assert first == hosts.address("hostp")


def test_an_isolated_host_has_no_route(hosts: Hosts) -> None:
    code = "from fabric.transfer.addresses import routed_address; print(routed_address())"
    assert _python_in(hosts, "hostp", code) == "None"


def test_advertise_settings_are_checked() -> None:
    wild = TransferConfig(host="0.0.0.0", advertise_host="10.0.0.5", secret="s")
    assert wild.advertised() == "10.0.0.5"
    assert TransferConfig().advertised() == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"advertise_host.*wildcard"):
        TransferConfig(host="0.0.0.0", advertise_host="0.0.0.0", secret="s")
    with pytest.raises(ConfigError, match="IPv6"):
        TransferConfig(host="::")
    with pytest.raises(ConfigError, match="IPv6"):
        advertised_host("0.0.0.0", "fe80::1")
    assert is_wildcard(" 0.0.0.0 ") and not is_wildcard("10.0.0.1")
    found = interface_address()
    assert found is None or not found.startswith("127.")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.77.0.3", "*", "fabric-d.example"])
def test_serving_beyond_loopback_needs_a_secret_or_insecure(
    host: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConfigError, match=r"transfer\.host.*no secret is set"):
        TransferConfig(host=host)
    TransferConfig(host=host, secret="s")
    TransferConfig(host=host, insecure=True)
    for local in ("127.0.0.1", "127.0.0.2", "localhost"):
        TransferConfig(host=local)
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.host.*no secret"):
        ConnectorConfig.from_extra({"host": host})
    assert ConnectorConfig.from_extra({"host": host, "insecure": "true"}).insecure
    with pytest.raises(ConfigError, match=r"^host.*no secret"):
        ServiceConfig(mem_bytes=1 << 20, host=host)
    ServiceConfig(mem_bytes=1 << 20, host=host, secret="s")


def test_fabric_store_serve_refuses_a_wide_bind_without_a_secret() -> None:
    argv = [sys.executable, "-m", "fabric.cli", "store", "serve", "--host", "0.0.0.0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert done.returncode == 2, done.stderr
    assert "no secret is set" in done.stderr


REPUSHER_SCRIPT = HERE / "repusher.py"
# NOTE: long enough for TCP keepalive to end UCX's connection (seen here: 40 s
# lost the push every time, 30 s now and then, 10 s never)
KEEPALIVE_PARTITION_S = 40


@pytest.mark.skipif(not nixl_available(), reason="no nixl")
def test_a_push_after_ucx_dropped_the_receiver_during_a_partition_lands(hosts: Hosts) -> None:
    """After a partition long enough for TCP keepalive to end UCX's
    connection, the next write was reported done while its bytes never
    landed (the receiver never heard of the transfer), and later ones were
    refused (NIXL_ERR_REMOTE_DISCONNECT) although the link was back. The
    sender loads the receiver's agent again before a write on a route left
    idle that long, and the push lands. The sender keeps progressing its
    data plane meanwhile, as an engine's threads do."""
    env = _env() | UCX_ENV
    receiver = Peer(
        "nixl", wrap=lambda argv: hosts.command("hostd", argv), extra=["0.0.0.0", "eth0"], env=env
    )
    argv = [
        sys.executable,
        str(REPUSHER_SCRIPT),
        "nixl",
        receiver.endpoint,
        str(CHUNKS),
        str(SLOT_BYTES),
        "eth0",
    ]
    pusher = subprocess.Popen(
        hosts.command("hostp", argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=HERE.parent.parent,
    )
    assert pusher.stdin is not None and pusher.stdout is not None

    def push(request_id: str, seed: int) -> dict:
        assert pusher.stdin is not None and pusher.stdout is not None
        pusher.stdin.write(f"push {request_id} {seed}\n")
        pusher.stdin.flush()
        return dict(json.loads(pusher.stdout.readline()))

    try:
        assert json.loads(pusher.stdout.readline()) == {"connected": True}
        assert push("before", 21) == {"ok": True, "error": None}
        hosts.cut("hostd")
        try:
            time.sleep(KEEPALIVE_PARTITION_S)
        finally:
            hosts.cut("hostd", cut=False)
        after = push("after", 22)
        assert after == {"ok": True, "error": None}, after
        seen = receiver.cmd("wait", "after", 30, 22)
        assert seen.get("complete") and seen["filled"] == CHUNKS and seen["bad"] == [], seen
    finally:
        pusher.stdin.write("quit\n")
        pusher.stdin.flush()
        try:
            pusher.wait(30)
        except subprocess.TimeoutExpired:
            pusher.kill()
            pusher.wait(10)
        receiver.stop()
