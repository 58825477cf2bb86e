"""Health probes: a refused connection marks an engine down at once; timeouts
take SLOW_PROBES_DOWN in a row (a busy engine on a loaded host misses one)."""

from __future__ import annotations

import asyncio
import errno
import socket

import httpx
import pytest

from fabric.router import engines
from fabric.router.engines import SLOW_PROBES_DOWN, Engine, probe

from .servers import dead_url, full_accept_queue


def run_probes(handler: object, engine: Engine, times: int) -> list[bool]:
    async def go() -> list[bool]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:  # type: ignore[arg-type]
            return [await probe(client, engine, 0.1) for _ in range(times)]

    return asyncio.run(go())


def test_timeouts_mark_down_only_after_several_in_a_row() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    # NOTE: a listener that never accepts: the engine is reachable, only slow
    # (an unreachable one is down at once: test_health_partition.py).
    with socket.create_server(("127.0.0.1", 0)) as busy:
        engine = Engine("d0", "decode", f"http://127.0.0.1:{busy.getsockname()[1]}", None)
        results = run_probes(slow, engine, SLOW_PROBES_DOWN)
    assert results == [True] * (SLOW_PROBES_DOWN - 1) + [False]
    assert not engine.healthy
    run_probes(lambda request: httpx.Response(200), engine, 1)
    assert engine.healthy and engine.slow_probes == 0


def test_refused_connection_marks_down_at_once() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    engine = Engine("d0", "decode", "http://127.0.0.1:1", None)
    assert run_probes(refused, engine, 1) == [False]
    assert not engine.healthy


def probe_while_reading(url: str, *, draining: bool = False) -> tuple[Engine, str]:
    """One probe that times out while a call reads from the engine (a stream);
    the engine and how the call ended (``reading``: it was not cut)."""

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    async def go() -> tuple[Engine, str]:
        engine = Engine("d0", "decode", url, None)
        engine.set_draining(draining)

        async def stream() -> None:
            with engine.calls.reading():
                await asyncio.get_running_loop().create_future()  # a silent engine

        reading = asyncio.create_task(stream())
        await asyncio.sleep(0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
            assert not await probe(client, engine, 0.1)
        await asyncio.sleep(0.01)
        if not reading.done():
            reading.cancel()
            return engine, "reading"
        return engine, repr(reading.exception())

    return asyncio.run(go())


@pytest.fixture
def quick_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timed-out probe's fresh connect gets 0.5 s, not 3."""
    monkeypatch.setattr(engines, "UNREACHABLE_CONNECT_S", 0.5)


@pytest.mark.usefixtures("quick_connect")
@pytest.mark.parametrize("draining", [False, True])
def test_a_timed_out_probe_then_a_refused_connect_cuts_nothing(draining: bool) -> None:
    """Down at once (nothing listens), but the host answered: a process
    restarting, a Service without ready endpoints; streams on connections
    made before may go on."""
    engine, ended = probe_while_reading(dead_url(), draining=draining)
    assert ended == "reading"
    assert (engine.healthy, engine.draining) == (False, draining)
    assert engine.last_error is not None and "refused" in engine.last_error, engine.last_error
    assert engine.calls.cut_total == 0


@pytest.mark.usefixtures("quick_connect")
@pytest.mark.parametrize("draining", [False, True])
def test_a_timed_out_probe_then_a_timed_out_connect_cuts(draining: bool) -> None:
    """Unreachable (a partition, a dead host), draining or not: its calls end."""
    with full_accept_queue() as url:
        engine, ended = probe_while_reading(url, draining=draining)
    assert ended.startswith("EngineUnreachable(") and "within 0.5 s" in ended, ended
    assert not engine.healthy and engine.calls.cut_total == 1


ANSWERS = {
    "no route": OSError(errno.EHOSTUNREACH, "No route to host"),
    "net down": OSError(errno.ENETUNREACH, "Network is unreachable"),
    "refused": ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
}


@pytest.fixture
def two_addresses(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``engine.test`` has an IPv4 and an IPv6 address; each connects as set
    (``connects``, ``hangs``, or one of ``ANSWERS``)."""
    how = {"10.0.0.1": "connects", "fd00::1": "connects"}

    def resolve(host: str, port: int, *args: object, **kw: object) -> list[tuple]:
        assert host == "engine.test", host
        stream = socket.SOCK_STREAM
        return [
            (socket.AF_INET, stream, 6, "", ("10.0.0.1", port)),
            (socket.AF_INET6, stream, 6, "", ("fd00::1", port, 0, 0)),
        ]

    async def connect(family: int, address: tuple) -> OSError | None:
        answer = how[address[0]]
        if answer == "hangs":
            await asyncio.sleep(60)
        return ANSWERS.get(answer)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(engines, "_connect", connect)
    return how


@pytest.mark.parametrize(
    ("v4", "v6", "unreachable"),
    [
        ("no route", "net down", True),
        ("no route", "hangs", True),
        ("hangs", "hangs", True),
        ("no route", "refused", False),
        ("refused", "hangs", False),
        ("no route", "connects", None),
        ("hangs", "connects", None),
    ],
)
def test_unreachable_is_every_address_timed_out_or_without_route(
    two_addresses: dict[str, str], v4: str, v6: str, unreachable: bool | None
) -> None:
    two_addresses.update({"10.0.0.1": v4, "fd00::1": v6})
    failure = asyncio.run(engines.tcp_connect_failure("http://engine.test:8000", 0.2))
    if unreachable is None:
        assert failure is None
        return
    assert failure is not None and failure.unreachable is unreachable, failure
    assert failure.reason.endswith("(unreachable)") is unreachable, failure
    assert ("refused" in failure.reason) is ("refused" in (v4, v6)), failure


@pytest.mark.usefixtures("quick_connect")
def test_a_timed_out_probe_then_no_route_cuts(two_addresses: dict[str, str]) -> None:
    two_addresses.update({"10.0.0.1": "no route", "fd00::1": "net down"})
    engine, ended = probe_while_reading("http://engine.test:8000")
    assert ended.startswith("EngineUnreachable(") and "No route to host" in ended, ended
    assert not engine.healthy and engine.calls.cut_total == 1
