"""Cache-aware routing and the /fabric/lookup|pin|clear admin routes.

Fake engines answer the HTTP side; each engine's fabric store is real: a
ChunkStore + TieredStore behind a TransferServer on its kv_port (loopback
data plane), filled with chunks of known prompts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from fabric.config import parse_topology
from fabric.launch.process import free_port
from fabric.router.engines import Engine
from fabric.router.policy import CacheAware
from fabric.store import ChunkStore, StoreConfig
from fabric.store.tier import TieredStore
from fabric.transfer import TransferConfig, TransferNode

from .conftest import StartEngine
from .servers import Proxy, ServerThread

CT = 16
FINGERPRINT = "test-model"
PROMPT = list(range(100, 100 + 5 * CT))  # 5 full chunks


class Store:
    """One engine's real store and control channel."""

    def __init__(self) -> None:
        self.store = ChunkStore(StoreConfig(slot_bytes=256, num_slots=32))
        self.tier = TieredStore(self.store, chunk_tokens=CT, fingerprint=FINGERPRINT)
        self.port = free_port()
        config = TransferConfig(transport="loopback", port=self.port)
        self.node = TransferNode(self.store, config, FINGERPRINT, tier=self.tier)
        self.closed = False

    def hold_chunks(self, tokens: list[int], count: int) -> None:
        for key in self.tier.keys(tokens)[:count]:
            slot = self.store.allocate(key)
            self.store.pool.slot_view(slot)[:64].fill_(7)
            self.store.commit(slot, key, 64)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.node.close()
            self.tier.close()


@pytest.fixture
def stores() -> Iterator[list[Store]]:
    made = [Store() for _ in range(3)]
    yield made
    for s in made:
        s.close()


def start(
    start_engine: StartEngine, servers: list[ServerThread], stores: list[Store], **proxy: object
) -> tuple[Proxy, list]:
    fakes = [start_engine("prefill"), start_engine("prefill"), start_engine("decode")]
    data = {
        "prefill": [
            {"name": f"p{i}", "url": fakes[i].url, "kv_port": stores[i].port} for i in (0, 1)
        ],
        "decode": [{"name": "d0", "url": fakes[2].url, "kv_port": stores[2].port}],
        # NOTE: sequential: these fake decoders answer at once, before P saw an early prefill
        "proxy": {"port": None, "health_interval_s": 0, "handoff": "sequential", **proxy},
    }
    server = Proxy(parse_topology(data, source="test")).start()
    servers.append(server)
    return server, fakes


def body(prompt: list[int]) -> dict[str, object]:
    return {"model": "fake", "prompt": prompt, "max_tokens": 2}


def test_cache_aware_policy_prefers_the_longest_prefix_within_a_load_bound() -> None:
    a, b = (Engine(n, "prefill", f"http://{n}", None) for n in ("a", "b"))
    policy = CacheAware(max_imbalance=2)
    assert policy.pick([a, b], {}, {"a": 0, "b": 32}) is b
    assert policy.pick([a, b], {}, {"a": 48, "b": 32}) is a
    b.outstanding = 3  # beyond the bound: the least loaded wins
    assert policy.pick([a, b], {}, {"a": 0, "b": 32}) is a
    b.outstanding = 2
    assert policy.pick([a, b], {}, {"a": 0, "b": 32}) is b
    assert policy.pick([a, b], {}, None) is a  # no hints: least outstanding


def test_lookup_reports_each_engines_prefix(
    start_engine: StartEngine,
    servers: list[ServerThread],
    stores: list[Store],
    client: httpx.Client,
) -> None:
    stores[0].hold_chunks(PROMPT, 3)
    stores[1].hold_chunks(PROMPT, 1)
    proxy, _ = start(start_engine, servers, stores)
    answer = client.post(proxy.url + "/fabric/lookup", json={"prompt": PROMPT})
    assert answer.status_code == 200, answer.text
    got = {e["name"]: e["hit_tokens"] for e in answer.json()["engines"]}
    assert got == {"p0": 3 * CT, "p1": CT, "d0": 0}
    assert answer.json()["prompt_tokens"] == len(PROMPT)


def test_cache_aware_routes_to_the_prefiller_holding_the_prefix(
    start_engine: StartEngine,
    servers: list[ServerThread],
    stores: list[Store],
    client: httpx.Client,
) -> None:
    stores[1].hold_chunks(PROMPT, 4)
    proxy, fakes = start(start_engine, servers, stores, policy="cache_aware")
    for _ in range(4):
        r = client.post(proxy.url + "/v1/completions", json=body([*PROMPT, 1, 2, 3]))
        assert r.status_code == 200, r.text
    assert len(fakes[1].seen) == 4 and len(fakes[0].seen) == 0
    # a prompt nobody holds is spread by load
    other = list(range(900, 900 + 3 * CT))
    for _ in range(4):
        assert client.post(proxy.url + "/v1/completions", json=body(other)).status_code == 200
    assert len(fakes[0].seen) == 2
    metrics = client.get(proxy.url + "/metrics").text
    assert "fabric_proxy_prefix_hits_total 4" in metrics


def test_pin_survives_clear_of_nothing_and_clear_empties_memory(
    start_engine: StartEngine,
    servers: list[ServerThread],
    stores: list[Store],
    client: httpx.Client,
) -> None:
    stores[0].hold_chunks(PROMPT, 5)
    proxy, _ = start(start_engine, servers, stores)
    pinned = client.post(proxy.url + "/fabric/pin", json={"prompt": PROMPT, "engine": "p0"})
    assert pinned.json()["engines"] == {"p0": {"chunks": 5}}
    assert stores[0].store.stats().pinned == 5
    cleared = client.post(proxy.url + "/fabric/clear", json={"tier": "memory"})
    assert cleared.json()["engines"] == {
        "p0": {"cleared": 5},
        "p1": {"cleared": 0},
        "d0": {"cleared": 0},
    }
    assert stores[0].store.stats().filled + stores[0].store.stats().pinned == 0


@pytest.mark.parametrize(
    ("path", "payload", "status", "param"),
    [
        ("/fabric/clear", {"tier": "everything"}, 400, "tier"),
        ("/fabric/clear", {"engine": "nope"}, 404, "engine"),
        ("/fabric/clear", {"engine": 3}, 400, "engine"),
        ("/fabric/lookup", {}, 400, "prompt"),
        ("/fabric/lookup", {"messages": "hi"}, 400, "messages"),
        ("/fabric/pin", {"prompt": PROMPT, "pin": "yes"}, 400, "pin"),
    ],
)
def test_bad_admin_requests_get_json_errors(
    start_engine: StartEngine,
    servers: list[ServerThread],
    stores: list[Store],
    client: httpx.Client,
    path: str,
    payload: dict[str, object],
    status: int,
    param: str,
) -> None:
    proxy, _ = start(start_engine, servers, stores)
    answer = client.post(proxy.url + path, json=payload)
    assert answer.status_code == status
    assert answer.json()["error"]["param"] == param
    raw = client.post(proxy.url + path, content=b"{not json")
    assert raw.status_code == 400 and "JSON" in raw.json()["error"]["message"]


def test_a_dead_store_is_reported_within_the_lookup_timeout(
    start_engine: StartEngine,
    servers: list[ServerThread],
    stores: list[Store],
    client: httpx.Client,
) -> None:
    stores[2].close()  # the decoder's control channel is gone
    proxy, _ = start(start_engine, servers, stores, lookup_timeout_ms=300)
    started = time.monotonic()
    answer = client.post(proxy.url + "/fabric/lookup", json={"prompt": PROMPT})
    assert time.monotonic() - started < 5
    by_name = {e["name"]: e for e in answer.json()["engines"]}
    assert by_name["d0"]["error"] and by_name["p0"]["error"] is None


def test_status_shows_each_engines_store(
    start_engine: StartEngine,
    servers: list[ServerThread],
    stores: list[Store],
    client: httpx.Client,
) -> None:
    stores[0].hold_chunks(PROMPT, 3)
    proxy, _ = start(start_engine, servers, stores)
    engines = {e["name"]: e for e in client.get(proxy.url + "/fabric/status").json()["engines"]}
    p0 = engines["p0"]["store"]
    assert (p0["filled"], p0["reserved"], p0["num_slots"], p0["holds"]) == (3, 0, 32, 0)
    assert engines["d0"]["store"]["filled"] == 0
    from fabric.launch.status import render_plain

    text = render_plain(client.get(proxy.url + "/fabric/status").json())
    assert "3/32 chunks, 0 reserved" in text
