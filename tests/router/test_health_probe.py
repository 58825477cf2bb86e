"""Health probes: a refused connection marks an engine down at once; timeouts
take SLOW_PROBES_DOWN in a row (a busy engine on a loaded host misses one)."""

from __future__ import annotations

import asyncio
import socket

import httpx

from fabric.router.engines import SLOW_PROBES_DOWN, Engine, probe


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
