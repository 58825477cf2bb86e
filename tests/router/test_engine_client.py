"""The proxy's engine client (the httptools pool) end to end: the flows, and
each failure it raises as the error the rest of the proxy answers.

Kept from when the proxy had three engine clients and this test ran on each.
"""

from __future__ import annotations

import time

import httpx

from .conftest import StartEngine, StartProxy
from .servers import dead_url
from .test_pd_flow import COMPLETION, expected_text, sse_events


def test_flows_and_failures_over_the_engine_client(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    slow = start_engine("decode", delay_s=2.0)
    stalling = start_engine("decode", token_delay_s=2.0)
    proxy = start_proxy([p.url], [d.url])
    down = start_proxy([dead_url()], [dead_url()])
    timeouts = start_proxy([p.url], [slow.url], decode_timeout_s=0.3)
    stall = start_proxy([p.url], [stalling.url], decode_timeout_s=0.3)

    plain = client.post(f"{proxy.url}/v1/completions", json=COMPLETION)
    stream = client.post(f"{proxy.url}/v1/completions", json={**COMPLETION, "stream": True})
    started = time.monotonic()
    unreachable = client.post(f"{down.url}/v1/completions", json=COMPLETION)
    timed_out = client.post(f"{timeouts.url}/v1/completions", json=COMPLETION)
    stalled = client.post(f"{stall.url}/v1/completions", json={**COMPLETION, "stream": True})

    assert plain.json()["choices"][0]["text"] == expected_text(COMPLETION)
    assert sse_events(stream.text)[-1] == "[DONE]"
    assert d.seen[0]["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    assert (unreachable.status_code, timed_out.status_code) == (502, 504)
    assert down.state.counters.fallbacks == 1
    assert '"upstream_timeout"' in sse_events(stalled.text)[-1]
    assert time.monotonic() - started < 5.0
