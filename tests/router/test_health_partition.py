"""A health probe tells a partitioned engine from a busy one.

Over a pooled keep-alive connection a probe sent during a partition only
times out, as one to a busy engine does, and a timed-out probe took
``SLOW_PROBES_DOWN`` in a row (three health intervals) to mark the engine
down. A fresh TCP connection tells them apart: the kernel completes it for
a busy engine, a partition drops it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from fabric.router.engines import tcp_connect_failure
from tests.netns import Hosts, hosts_or_skip

from .servers import child, fake_engine_on, full_accept_queue

PORT = 8100
PROBE_TIMEOUT_S = 1.0
# Runs in the proxy's host: probe until the engine answers, then once per stdin line.
PROBER = f"""
import asyncio, json, sys, httpx
from fabric.router.engines import Engine, probe
async def main():
    engine = Engine("d0", "decode", sys.argv[1], None)
    async with httpx.AsyncClient() as client:
        for _ in range(300):
            if await probe(client, engine, {PROBE_TIMEOUT_S}):
                break
            await asyncio.sleep(0.1)
        print(json.dumps({{"healthy": engine.healthy}}), flush=True)
        for _ in sys.stdin:
            healthy = await probe(client, engine, {PROBE_TIMEOUT_S})
            out = {{"healthy": healthy, "error": engine.last_error, "slow": engine.slow_probes}}
            print(json.dumps(out), flush=True)
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with hosts_or_skip(["proxy", "engine"]) as made:
        yield made


def test_a_partitioned_engine_is_down_after_one_timed_out_probe(hosts: Hosts) -> None:
    with (
        fake_engine_on(hosts, "engine", PORT) as url,
        child(
            hosts.command("proxy", [sys.executable, "-c", PROBER, url]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        ) as prober,
    ):
        assert prober.stdin is not None and prober.stdout is not None

        def ask() -> dict:
            assert prober.stdin is not None and prober.stdout is not None
            prober.stdin.write("probe\n")
            prober.stdin.flush()
            return dict(json.loads(prober.stdout.readline()))

        assert json.loads(prober.stdout.readline()) == {"healthy": True}
        assert ask() == {"healthy": True, "error": None, "slow": 0}
        hosts.cut("engine")
        try:
            down = ask()
        finally:
            hosts.cut("engine", cut=False)
        assert down["healthy"] is False, down
        assert "unreachable" in down["error"] and down["slow"] == 0, down
        # Healed: the next probe brings it back.
        assert ask()["healthy"] is True


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_tcp_connect_failure_says_why(loop: str) -> None:
    """On uvloop too: uvicorn runs the proxy on it (its create_connection has no
    happy eyeballs option: every probe that timed out failed on it)."""
    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        with socket.create_server(("127.0.0.1", 0)) as listening:
            port = listening.getsockname()[1]
            assert runner.run(tcp_connect_failure(f"http://127.0.0.1:{port}/x", 1.0)) is None
        gone = runner.run(tcp_connect_failure(f"http://127.0.0.1:{port}", 1.0))
        with full_accept_queue() as url:
            silent = runner.run(tcp_connect_failure(url, 0.3))
    assert gone is not None and not gone.unreachable, gone
    assert gone.reason.startswith(f"TCP connect to 127.0.0.1:{port} refused: "), gone
    assert silent is not None and silent.unreachable, silent
    assert silent.reason.endswith("within 0.3 s (unreachable)"), silent


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connect_check_needs_no_resolver_thread_for_an_address(loop: str) -> None:
    """Every thread of the loop's default executor busy (store calls, say):
    an engine at an IP address is still checked, not reported 'not
    resolved' (then its calls were never cut)."""
    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None
    busy = threading.Event()

    async def check(url: str) -> object:
        loop_ = asyncio.get_running_loop()
        for _ in range(64):
            loop_.run_in_executor(None, busy.wait, 5)
        return await tcp_connect_failure(url, 0.5)

    with (
        asyncio.Runner(loop_factory=factory) as runner,
        socket.create_server(("127.0.0.1", 0)) as listening,
    ):
        port = listening.getsockname()[1]
        try:
            failure = runner.run(check(f"http://127.0.0.1:{port}/health"))
        finally:
            busy.set()
    assert failure is None, failure


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_loop_that_stalled_past_the_deadline_still_sees_the_connect(loop: str) -> None:
    """The proxy's loop blocked for longer than the check's bound while the
    kernel completed the connect: the timer fires in the same turn as the
    connect; the engine connected, so it is not unreachable."""
    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None

    async def check(url: str) -> object:
        asyncio.get_running_loop().call_soon(time.sleep, 0.6)  # the stall
        return await tcp_connect_failure(url, 0.2)

    with (
        asyncio.Runner(loop_factory=factory) as runner,
        socket.create_server(("127.0.0.1", 0)) as listening,
    ):
        port = listening.getsockname()[1]
        failure = runner.run(check(f"http://127.0.0.1:{port}/health"))
    assert failure is None, failure
