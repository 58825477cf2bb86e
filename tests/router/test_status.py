"""``GET /fabric/status`` and ``fabric status``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from fabric.cli import main
from fabric.launch.status import DEFAULT_URL, proxy_url, render_plain
from fabric.shared_store.service import ServiceConfig, SharedStore

from .conftest import StartEngine, StartProxy
from .servers import Proxy, ServerThread, dead_url, topology
from .test_pd_flow import COMPLETION


def test_status_lists_engines_counters_and_in_flight(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url, dead_url()], prefill_policy="least_outstanding")
    assert client.post(f"{proxy.url}/v1/completions", json=COMPLETION).status_code == 200
    proxy.state.pool.decoders[1].mark_down("ConnectError: refused")

    status = client.get(f"{proxy.url}/fabric/status").json()

    stores = [engine.pop("store") for engine in status["engines"]]
    since = [engine.pop("since") for engine in status["engines"]]
    assert stores[0] is None  # no kv_port: nothing to ask
    assert "no connection" in stores[1]["error"] or "no answer" in stores[1]["error"]
    assert stores[2] is None  # down: its numbers are unknown
    assert since[2] == proxy.state.pool.decoders[1].since
    assert status["engines"] == [
        {"name": "prefill-0", "role": "prefill", "url": p.url, "healthy": True,
         "state": "up", "outstanding": 0, "error": None},
        {"name": "decode-0", "role": "decode", "url": d.url, "healthy": True,
         "state": "up", "outstanding": 0, "error": None},
        {"name": "decode-1", "role": "decode", "url": proxy.state.pool.decoders[1].url,
         "healthy": False, "state": "down", "outstanding": 0, "error": "ConnectError: refused"},
    ]  # fmt: skip
    assert status["counters"]["requests"] == 1
    assert status["counters"]["local_decodes"] == 0
    assert status["in_flight"] == 0
    assert status["policies"] == {"prefill": "least_outstanding", "decode": "round_robin"}


def test_fabric_status_prints_a_table(
    start_engine: StartEngine,
    start_proxy: StartProxy,
    capsys: pytest.CaptureFixture[str],
) -> None:
    p, d = start_engine("prefill"), start_engine("decode")
    proxy = start_proxy([p.url], [d.url])

    assert main(["status", "--url", proxy.url]) == 0

    out = capsys.readouterr().out
    assert "prefill-0" in out and "decode-0" in out and "in_flight" in out


def test_fabric_status_fails_with_a_message_when_no_proxy_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = dead_url()

    assert main(["status", "--url", url]) == 1

    assert f"fabric status: no status from {url}" in capsys.readouterr().err


def test_status_url_comes_from_up_json(tmp_path: Path) -> None:
    assert proxy_url(None, tmp_path) == DEFAULT_URL
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "up.json").write_text(json.dumps({"proxy_url": "http://h:9/"}))

    assert proxy_url(None, tmp_path) == "http://h:9"
    assert proxy_url("http://x:1", tmp_path) == "http://x:1"


def test_plain_table_is_aligned() -> None:
    status = {
        "engines": [{"name": "p", "role": "prefill", "url": "http://a", "healthy": True,
                     "outstanding": 2, "error": None}],
        "counters": {"requests": 3},
        "in_flight": 1,
    }  # fmt: skip

    text = render_plain(status)

    assert "p     prefill  yes      2" in text.splitlines()
    assert "  http://a" in text.splitlines()
    assert "requests" in text and "in_flight" in text


def test_status_shows_the_shared_store(
    start_engine: StartEngine, servers: list[ServerThread], client: httpx.Client
) -> None:
    """A topology with ``connector.shared_store``: ``/fabric/status`` asks the
    running store (a real ``SharedStore`` over TCP) for its occupancy and
    fetch counters, and ``fabric status`` draws it as its own table."""
    store = SharedStore(ServiceConfig(mem_bytes=1 << 20, transport="tcp")).start()
    try:
        p, d = start_engine("prefill"), start_engine("decode")
        config, _ = topology([p.url], [d.url])
        address = store.endpoint.removeprefix("tcp://")  # host:port, as a YAML gives it
        connector = config.connector.model_copy(update={"shared_store": address})
        proxy = Proxy(config.model_copy(update={"connector": connector})).start()
        servers.append(proxy)

        status = client.get(f"{proxy.url}/fabric/status").json()

        shared = status["shared_store"]
        assert shared["endpoint"] == store.endpoint
        assert shared["service_attaches"] == 0 and shared["reserved"] == 0
        text = render_plain(status)
        assert "shared store" in text and store.endpoint in text and "attaches" in text
    finally:
        store.close()
    status = client.get(f"{proxy.url}/fabric/status").json()
    error = status["shared_store"]["error"]
    assert "no answer" in error or "no connection" in error  # gone: bounded, reported


def test_status_without_a_shared_store_says_none(
    start_engine: StartEngine, start_proxy: StartProxy, client: httpx.Client
) -> None:
    proxy = start_proxy([start_engine("prefill").url], [start_engine("decode").url])
    status = client.get(f"{proxy.url}/fabric/status").json()
    assert status["shared_store"] is None
    assert "shared store" not in render_plain(status)


def test_status_forgets_the_shared_store_endpoint_it_moved_from(
    start_engine: StartEngine, servers: list[ServerThread], client: httpx.Client, tmp_path: Path
) -> None:
    """The shared store restarted on another port (its endpoint file says
    so): the proxy drops its clients of the old endpoint, whose sockets
    would otherwise reconnect to a dead port forever."""
    first = SharedStore(ServiceConfig(mem_bytes=1 << 20, transport="tcp")).start()
    second = SharedStore(ServiceConfig(mem_bytes=1 << 20, transport="tcp")).start()
    try:
        endpoint_file = tmp_path / "store.endpoint"
        endpoint_file.write_text(first.endpoint)
        p, d = start_engine("prefill"), start_engine("decode")
        config, _ = topology([p.url], [d.url])
        connector = config.connector.model_copy(update={"shared_store": str(endpoint_file)})
        proxy = Proxy(config.model_copy(update={"connector": connector})).start()
        servers.append(proxy)
        calls = proxy.state.stores

        assert client.get(f"{proxy.url}/fabric/status").json()["shared_store"]["endpoint"] == (
            first.endpoint
        )
        assert first.endpoint in calls.endpoints
        endpoint_file.write_text(second.endpoint)
        client.get(f"{proxy.url}/fabric/status")  # finds it moved
        status = client.get(f"{proxy.url}/fabric/status").json()  # the next calls drop it

        assert status["shared_store"]["endpoint"] == second.endpoint
        assert first.endpoint not in calls.endpoints and second.endpoint in calls.endpoints
    finally:
        first.close()
        second.close()
