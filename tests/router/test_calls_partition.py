"""A stream from an engine cut off by a partition ends with an error event.

The fake decoder streams a token every 0.1 s in one namespace; a proxy and
its client run in another (``DRIVER``). Once the stream runs, the engine's
host is cut off (``Hosts.cut``: no bytes, no RST, no FIN), and the proxy
learns it from its health probe (timed out, and a fresh TCP connection
fails) or from a second request whose connect times out. Without the cut
the relay would wait ``decode_timeout_s`` (600 s) for the next chunk.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.netns import Hosts, hosts_or_skip

from .servers import child, fake_engine_on

PORT = 8200
BOUND_S = 20.0
"""Cut to error event, generously: ~5 s expected (probe interval 1 s, its
timeout 1 s, the fresh connect's 3 s; or a 1 s connect timeout then 3 s)."""
# Runs in the proxy's host: a proxy, and a client streaming through it; the
# stream's first events reported, then (after a stdin line: the host is cut)
# how it ended and what the proxy holds once the request is over.
DRIVER = """
import json, sys, threading, time
import httpx
from tests.router.servers import Proxy, topology

url, trigger = sys.argv[1:3]
for _ in range(300):
    try:
        if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
            break
    except httpx.HTTPError:
        time.sleep(0.1)
config, _ = topology(
    [url], [url], health_timeout_s=1.0, connect_timeout_s=1.0,
    health_interval_s=1.0 if trigger == "probe" else 0,
    disaggregate_min_prompt_tokens=1_000_000,  # D alone: one engine, one stream
)
proxy = Proxy(config).start()
completions = proxy.url + "/v1/completions"
body = {"model": "fake", "prompt": "across hosts", "max_tokens": 100000, "stream": True}
events, second, posts = [], [], []
with httpx.Client(timeout=30.0, trust_env=False) as client:
    try:
        with client.stream("POST", completions, json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 3:
                    print(json.dumps({"streaming": True}), flush=True)
                    sys.stdin.readline()
                    if trigger == "request":
                        post = lambda: second.append(httpx.post(
                            completions, json={**body, "stream": False}, timeout=30.0
                        ).status_code)
                        posts.append(threading.Thread(target=post, daemon=True))
                        posts[-1].start()
    except httpx.HTTPError as exc:
        events.append(f"client: {type(exc).__name__}")

for thread in posts:
    thread.join(30)

async def read(state):
    return {
        "in_flight": state.in_flight, "tables": state.tables(),
        "calls_cut": state.counter_values().get("calls_cut"),
        "outstanding": [e.outstanding for e in state.pool.engines],
    }
for _ in range(100):
    held = proxy.run(read)
    if not any(held["tables"].values()):
        break
    time.sleep(0.1)
print(json.dumps({"last": events[-1], "events": len(events), "second": second, **held}), flush=True)
proxy.stop()
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with hosts_or_skip(["proxy", "engine"]) as made:
        yield made


@pytest.mark.parametrize("trigger", ["probe", "request"])
def test_a_partitioned_decoder_ends_its_stream_with_an_error_event(
    hosts: Hosts, trigger: str
) -> None:
    with (
        fake_engine_on(hosts, "engine", PORT, "--token-delay-s", "0.1") as url,
        child(
            hosts.command("proxy", [sys.executable, "-c", DRIVER, url, trigger]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        ) as driver,
    ):
        assert driver.stdin is not None and driver.stdout is not None
        line = driver.stdout.readline()
        assert line, f"the driver exited ({driver.poll()}) before its stream ran"
        assert json.loads(line) == {"streaming": True}
        hosts.cut("engine")
        cut_at = time.monotonic()
        try:
            driver.stdin.write("cut\n")
            driver.stdin.flush()
            line = driver.stdout.readline()
            took = time.monotonic() - cut_at
        finally:
            hosts.cut("engine", cut=False)
        assert line, f"the driver exited ({driver.poll()}) before its stream ended"
        ended = json.loads(line)

    assert ended["last"].startswith("{"), ended  # an error event, not the client's timeout
    error = json.loads(ended["last"])["error"]
    assert error["type"] == "upstream_error", error
    assert "decode engine decode-0" in error["message"], error
    assert "became unreachable" in error["message"], error
    assert took < BOUND_S, f"the error event came {took:.1f} s after the partition"
    assert ended["in_flight"] == 0 and ended["outstanding"] == [0, 0], ended
    assert ended["tables"] == dict.fromkeys(ended["tables"], 0), ended
    assert ended["calls_cut"] == 1, ended
    if trigger == "request":
        assert ended["second"] == [502], ended
