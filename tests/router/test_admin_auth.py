"""The proxy's admin routes (``POST /fabric/lookup|clear|pin``) take a bearer
token: a call without it, with a wrong one or another scheme is a 401 JSON
error, counted, and touches no store; ``/health``, ``/metrics`` and
``/fabric/status`` stay open. A proxy bound beyond loopback whose admin
routes would be open refuses to start (``fabric proxy``; ``fabric up`` generates a
secret instead) unless ``connector.insecure``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from fabric.config import parse_topology
from fabric.errors import ConfigError
from fabric.launch.process import free_port
from fabric.router.admin import admin_token, authorized, check_admin_exposure

from .conftest import StartEngine
from .servers import Proxy, ServerThread
from .test_prefix_routes import PROMPT, Store

TOKEN = "admin-token-for-tests"
TOKEN_ENV = "FABRIC_TEST_ADMIN_TOKEN"
SECRET_ENV = "FABRIC_TEST_ADMIN_SECRET"


@pytest.fixture
def store() -> Iterator[Store]:
    made = Store()
    yield made
    made.close()


def test_authorized_needs_the_exact_bearer_token() -> None:
    assert authorized(None, None) and authorized("Bearer x", None)
    assert authorized(f"Bearer {TOKEN}", TOKEN) and authorized(f"bearer  {TOKEN} ", TOKEN)
    for header in (None, "", "Bearer", f"Basic {TOKEN}", f"Bearer {TOKEN}x", TOKEN, "Bearer "):
        assert not authorized(header, TOKEN), header


def test_admin_calls_without_the_token_are_refused_counted_and_touch_nothing(
    start_engine: StartEngine,
    servers: list[ServerThread],
    store: Store,
    client: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    store.hold_chunks(PROMPT, 3)
    d = start_engine("decode")
    data = {
        "prefill": [{"name": "p0", "url": start_engine("prefill").url}],
        "decode": [{"name": "d0", "url": d.url, "kv_port": store.port}],
        "proxy": {"port": None, "health_interval_s": 0, "admin_token_env": TOKEN_ENV},
    }
    proxy = Proxy(parse_topology(data, source="test")).start()
    servers.append(proxy)
    url = proxy.url
    bad = [{}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {TOKEN}"}]
    for path, body in (
        ("/fabric/clear", {"tier": "all"}),
        ("/fabric/pin", {"prompt": PROMPT}),
        ("/fabric/lookup", {"prompt": PROMPT}),
    ):
        for headers in bad:
            answer = client.post(url + path, json=body, headers=headers)
            assert answer.status_code == 401, (path, headers, answer.text)
            assert answer.headers["www-authenticate"] == "Bearer"
            assert answer.json()["error"]["type"] == "authentication_error"
    assert store.store.stats().filled == 3 and store.store.stats().pinned == 0
    metrics = client.get(url + "/metrics")
    assert metrics.status_code == 200
    assert "fabric_proxy_admin_refused_total 9" in metrics.text
    assert client.get(url + "/fabric/status").status_code == 200

    auth = {"authorization": f"Bearer {TOKEN}"}
    looked = client.post(url + "/fabric/lookup", json={"prompt": PROMPT}, headers=auth)
    assert looked.status_code == 200, looked.text
    assert {e["name"]: e["hit_tokens"] for e in looked.json()["engines"]}["d0"] == 48
    cleared = client.post(url + "/fabric/clear", json={"tier": "memory"}, headers=auth)
    assert cleared.json()["engines"]["d0"] == {"cleared": 3}
    assert proxy.state.counters.admin_refused == 9


def test_the_connector_secret_is_the_default_admin_token(
    start_engine: StartEngine,
    servers: list[ServerThread],
    client: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, "the-shared-secret")
    data = {
        "prefill": [{"name": "p0", "url": start_engine("prefill").url}],
        "decode": [{"name": "d0", "url": start_engine("decode").url, "kv_port": free_port()}],
        "proxy": {"port": None, "health_interval_s": 0, "lookup_timeout_ms": 200},
        "connector": {"secret_env": SECRET_ENV},
    }
    proxy = Proxy(parse_topology(data, source="test")).start()
    servers.append(proxy)
    body = {"prompt": PROMPT}
    assert client.post(proxy.url + "/fabric/lookup", json=body).status_code == 401
    auth = {"authorization": "Bearer the-shared-secret"}
    answer = client.post(proxy.url + "/fabric/lookup", json=body, headers=auth)
    assert answer.status_code == 200, answer.text  # d0's store is down: an error per engine
    assert {e["name"] for e in answer.json()["engines"]} == {"p0", "d0"}


def test_an_open_admin_api_beyond_loopback_is_refused_unless_insecure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = {"prefill": [{"url": "http://127.0.0.1:1"}], "decode": [{"url": "http://127.0.0.1:2"}]}
    topology = parse_topology(base, source="test")
    check_admin_exposure(topology, "127.0.0.1")
    for host in ("0.0.0.0", "10.77.0.2", "::"):
        with pytest.raises(ConfigError, match=r"proxy\.host: .*admin routes.*token_hex"):
            check_admin_exposure(topology, host)
    check_admin_exposure(parse_topology({**base, "connector": {"insecure": True}}), "0.0.0.0")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with_token = parse_topology({**base, "proxy": {"admin_token_env": TOKEN_ENV}})
    check_admin_exposure(with_token, "0.0.0.0")
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(ConfigError, match=f"proxy.admin_token_env: .*{TOKEN_ENV}"):
        check_admin_exposure(with_token, "0.0.0.0")
    monkeypatch.setenv(TOKEN_ENV, f"{TOKEN}\n")  # a Secret made from a file
    assert admin_token(with_token) == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "two words")
    with pytest.raises(ConfigError, match="holds whitespace"):
        admin_token(with_token)


def test_fabric_proxy_refuses_an_open_admin_api_on_a_wildcard(tmp_path: Path) -> None:
    """(``fabric up`` generates a secret instead: tests/launch/test_hosts.py.)"""
    command = "proxy"
    config = {
        "prefill": [{"url": "http://127.0.0.1:1"}],
        "decode": [{"url": "http://127.0.0.1:2", "kv_port": free_port()}],
        "proxy": {"host": "0.0.0.0", "port": free_port()},
        "workdir": str(tmp_path / "work"),
    }
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "fabric.cli", command, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"fabric {command}: proxy.host: '0.0.0.0' is reachable" in done.stderr
