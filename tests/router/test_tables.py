"""The proxy's per-request state is pruned however a request ends.

Mixed requests through one proxy: finished (JSON and streams), clients gone
mid-stream or before their answer, decoder errors, an unreachable decoder
(retried elsewhere), failed prefills that fell back to decode-only, and
requests past their deadline. Afterwards every table on ``/metrics`` and
``/fabric/status`` is 0 and every engine's ``outstanding`` is 0.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from .conftest import StartEngine, StartProxy
from .servers import dead_url
from .test_pd_flow import COMPLETION

TABLE = re.compile(r'^fabric_proxy_table_entries\{table="([^"]+)"\} (\d+)$', re.M)


async def one(client: httpx.AsyncClient, url: str, i: int) -> str:
    """Request ``i``: a JSON or stream request; every third client leaves early."""
    stream = i % 2 == 1
    body = {**COMPLETION, "stream": stream, "max_tokens": 20}
    try:
        if i % 3 == 0 and stream:
            async with client.stream("POST", url, json=body) as response:
                async for _ in response.aiter_raw():
                    break  # gone mid-stream (or mid-error answer)
            return "left"
        # NOTE: only the wait for the answer is short: a client whose request
        # never reached the proxy (its connect slow on a busy machine) would
        # leave without the proxy seeing a disconnect
        timeout = httpx.Timeout(30.0, read=0.3) if i % 3 == 0 else httpx.Timeout(30.0)
        response = await client.post(url, json=body, timeout=timeout)
        return str(response.status_code)
    except httpx.TimeoutException:
        return "left"


def test_every_table_is_empty_after_mixed_endings(
    start_engine: StartEngine, start_proxy: StartProxy
) -> None:
    prefillers = [
        start_engine("prefill"),
        start_engine("prefill", fail_status=500),  # fallback to decode-only
        start_engine("prefill", delay_s=0.5),  # clients leave during the prefill
    ]
    decoders = [
        start_engine("decode", token_delay_s=0.02),
        start_engine("decode", fail_status=500),  # engine error
        start_engine("decode", delay_s=5.0),  # past the deadline
    ]
    proxy = start_proxy(
        [e.url for e in prefillers],
        [*(e.url for e in decoders), dead_url()],  # unreachable: retried on another
        request_deadline_s=1.5,
    )
    url = f"{proxy.url}/v1/completions"

    async def send_all() -> list[str]:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            return await asyncio.gather(*(one(client, url, i) for i in range(36)))

    outcomes = asyncio.run(send_all())
    state = proxy.state
    deadline = time.monotonic() + 30
    while state.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)

    assert {"200", "500", "504", "left"} <= set(outcomes), outcomes
    counters = state.counters
    assert counters.fallbacks and counters.client_disconnects and counters.deadline_exceeded
    assert counters.decode_errors  # the unreachable decoder
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    tables = {name: int(n) for name, n in TABLE.findall(metrics)}
    assert set(tables) >= {"requests", "streams", "canaries", "store_calls", "pool_busy"}
    assert tables == dict.fromkeys(tables, 0), tables
    status = httpx.get(f"{proxy.url}/fabric/status", timeout=10).json()
    # NOTE: /fabric/status asks the stores itself (nobody listens on these kv
    # ports): its own calls may still be ending in their threads.
    own = {"store_calls", "store_waiters"}
    assert {k: n for k, n in status["tables"].items() if k not in own} == {
        k: n for k, n in tables.items() if k not in own
    }
    assert status["in_flight"] == 0 and status["oldest_request_s"] is None
    assert [e["outstanding"] for e in status["engines"]] == [0] * 7
    assert all(e.outstanding == 0 for e in state.pool.engines)
    assert 'fabric_proxy_engine_outstanding{engine="decode-0",role="decode"} 0\n' in metrics
