"""Topologies across hosts: ``hosts:``, each engine's ``host:``, ``fabric up --host NAME``.

The config and placement tests need nothing; the last test runs ``fabric up
--host`` in three network namespaces (simulated hosts, :mod:`tests.netns`)
with fake engines, and sends a request through the proxy on its own host.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fabric.config import TopologyConfig, parse_topology
from fabric.errors import ConfigError
from fabric.launch import up
from fabric.launch.hosts import engine_bind, host_entry, host_environment, place
from fabric.launch.secret import SECRET_ENV, needs_secret, with_secret
from tests.launch._up import FAKE, UpRun
from tests.netns import Hosts, hosts_or_skip

SECRET_VAR = "FABRIC_TEST_HOSTS_SECRET"
ROOT = Path(__file__).parent.parent.parent


def topology(**changes: Any) -> dict[str, Any]:
    """Three hosts: a prefiller on hostp, a decoder on hostd, the proxy on hostx."""
    data: dict[str, Any] = {
        "model": "m",
        "hosts": {
            "hostp": {"address": "10.77.0.2"},
            "hostd": {"address": "10.77.0.3", "bind": "0.0.0.0", "ucx_tls": "tcp"},
            "hostx": {"address": "10.77.0.4", "ucx_net_devices": "eth0", "env": {"X": 1}},
        },
        "prefill": [{"host": "hostp", "port": 8100, "kv_port": 8101}],
        "decode": [{"host": "hostd", "port": 8100, "kv_port": 8101}],
        "proxy": {"host": "hostx", "port": 8000},
        "connector": {"secret_env": SECRET_VAR},
    }
    for key, value in changes.items():
        data[key] = value
    return data


def test_engines_are_reached_at_their_hosts_address() -> None:
    parsed = parse_topology(topology())
    p, d = parsed.prefill[0], parsed.decode[0]
    assert (p.address, p.base_url, p.kv_endpoint) == (
        "10.77.0.2",
        "http://10.77.0.2:8100",
        "tcp://10.77.0.2:8101",
    )
    assert (d.base_url, d.kv_endpoint) == ("http://10.77.0.3:8100", "tcp://10.77.0.3:8101")
    assert (parsed.proxy_host, parsed.proxy_address, parsed.proxy_bind) == (
        "hostx",
        "10.77.0.4",
        "10.77.0.4",
    )
    assert parsed.spans_hosts and parsed.host_name("10.77.0.3") == "hostd"
    # NOTE: an engine may name its host by its address, too.
    by_address = topology(decode=[{"host": "10.77.0.3", "port": 8100, "kv_port": 8101}])
    assert parse_topology(by_address).engines_on("hostd")[0].base_url == "http://10.77.0.3:8100"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prefill": [{"host": "hostq", "port": 1, "kv_port": 2}]}, r"prefill\[0\]\.host: 'hostq'"),
        ({"prefill": [{"port": 1, "kv_port": 2}]}, r"prefill\[0\]\.host: missing"),
        ({"prefill": [{"host": "hostp", "kv_port": 2}]}, r"prefill\[0\]\.port: prefill-0 runs"),
        ({"decode": [{"host": "hostd", "port": 2}]}, r"decode\[0\]\.kv_port: decode-0 runs"),
        ({"proxy": {"host": "0.0.0.0", "port": 8000}}, r"proxy\.host: '0\.0\.0\.0' is none of"),
        ({"proxy": {"host": "hostx", "port": None}}, r"proxy\.port: a topology across hosts"),
        ({"connector": {}}, r"connector\.secret_env: a topology across hosts needs"),
        (
            {"prefill": [{"host": "hostp", "port": 1, "kv_port": 2, "host_address": "1.2.3.4"}]},
            r"prefill\[0\]\.host_address: derived from host",
        ),
        ({"prefill": [{"url": "http://10.77.0.2:1", "host": "hostp"}]}, "host: a running"),
        ({"hosts": {"hostp": {"address": "fe80::1"}}}, r"hosts\.hostp\.address: .*IPv4 only"),
        ({"hosts": {"hostp": {"adress": "10.0.0.1"}}}, r"hosts\.hostp\.adress: Extra inputs"),
    ],
)
def test_a_bad_host_setting_names_its_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_topology(topology(**changes), source="t.yaml")


def test_a_host_needs_a_hosts_section_and_insecure_replaces_the_secret() -> None:
    with pytest.raises(ConfigError, match=r"prefill\[0\]\.host: 'hostp', but the topology has no"):
        parse_topology({"prefill": [{"model": "m", "host": "hostp"}], "decode": [{"model": "m"}]})
    parse_topology(topology(connector={"insecure": True}))
    loopback = {"a": {"address": "127.0.0.1"}}
    engines = {"host": "a"}
    parse_topology(
        topology(
            hosts=loopback, prefill=[engines], decode=[engines], proxy={"host": "a"}, connector={}
        )
    )


def test_fabric_up_on_a_host_without_the_proxy_starts_only_its_engines() -> None:
    parsed = parse_topology(topology())
    here = place(parsed, "hostd")
    assert not here.proxy and here.host == "hostd"
    assert [e.name for e in here.topology.engines] == ["decode-0"]
    assert here.topology.decode[0].launched
    assert here.proxy_url == "http://10.77.0.4:8000"


def test_the_proxys_host_reaches_the_other_hosts_engines_as_running_ones() -> None:
    data = topology()
    data["prefill"].append({"host": "hostx", "name": "local"})  # free ports: on the proxy's host
    here = place(parse_topology(data), "hostx")
    assert here.proxy
    remote_p, local_p = here.topology.prefill
    remote_d = here.topology.decode[0]
    assert not remote_p.launched and remote_p.url == "http://10.77.0.2:8100"
    assert (remote_d.url, remote_d.kv_endpoint) == ("http://10.77.0.3:8100", "tcp://10.77.0.3:8101")
    assert local_p.launched and local_p.address == "10.77.0.4"
    resolved = up.resolve_ports(here.topology)
    assert resolved.prefill[1].base_url.startswith("http://10.77.0.4:")


def test_fabric_up_needs_the_host_name_where_there_are_hosts() -> None:
    parsed = parse_topology(topology())
    with pytest.raises(
        ConfigError, match=r"hosts: the topology spans hosts \(hostp, hostd, hostx\)"
    ):
        place(parsed, None)
    with pytest.raises(ConfigError, match=r"--host 'hostq': none of hosts"):
        place(parsed, "hostq")
    single = parse_topology({"prefill": [{"model": "m"}], "decode": [{"model": "m"}]})
    with pytest.raises(ConfigError, match="--host 'hostp': the topology has no hosts"):
        place(single, "hostp")
    assert place(single, None).topology is single


def test_an_engine_binds_its_hosts_bind_and_advertises_its_address(tmp_path: Path) -> None:
    data = topology(workdir=str(tmp_path))
    data["decode"][0]["command"] = [*FAKE, "--host", "{host}", "--advertise={address}"]
    parsed = parse_topology(data)
    p, d = parsed.prefill[0], parsed.decode[0]
    command = up.engine_command(p, parsed)
    assert command[command.index("--host") + 1] == "10.77.0.2"
    kv = json.loads(command[command.index("--kv-transfer-config") + 1])
    extra = kv["kv_connector_extra_config"]
    assert extra["host"] == "10.77.0.2" and "advertise_host" not in extra
    assert extra["secret_env"] == SECRET_VAR
    command = up.engine_command(d, parsed)
    assert command[-2:] == ["0.0.0.0", "--advertise=10.77.0.3"]
    extra = up.kv_transfer_config(d, parsed.connector, bind=engine_bind(parsed, d))
    assert extra["kv_connector_extra_config"]["host"] == "0.0.0.0"
    assert extra["kv_connector_extra_config"]["advertise_host"] == "10.77.0.3"


def test_an_engine_takes_its_hosts_address_and_ucx_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv("UCX_TLS", raising=False)
    data = topology(workdir=str(tmp_path))
    data["prefill"][0]["env"] = {"X": "engine"}
    data["prefill"].append({"host": "hostx", "name": "x"})
    parsed = parse_topology(data)
    p, d = parsed.prefill[0], parsed.decode[0]
    env = up.engine_environment(p, parsed)
    assert env["VLLM_HOST_IP"] == "10.77.0.2"
    # NOTE: no lo across hosts: UCX picks among every device unless the host names them.
    assert "UCX_NET_DEVICES" not in env and "UCX_TLS" not in env and env["X"] == "engine"
    env = up.engine_environment(d, parsed)
    assert (env["VLLM_HOST_IP"], env["UCX_TLS"]) == ("10.77.0.3", "tcp")
    env = up.engine_environment(parsed.prefill[1], parsed)
    assert (env["UCX_NET_DEVICES"], env["X"]) == ("eth0", "1")
    # The operator's own UCX settings reach the engines a host does not configure.
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    env = up.engine_environment(p, parsed)
    assert (env["UCX_NET_DEVICES"], env["UCX_TLS"]) == ("mlx5_0:1", "rc,tcp")
    assert up.engine_environment(d, parsed)["UCX_TLS"] == "tcp"
    monkeypatch.delenv("UCX_NET_DEVICES")
    monkeypatch.delenv("UCX_TLS")
    # A single-host topology keeps the loopback defaults.
    single = parse_topology(
        {"workdir": str(tmp_path), "prefill": [{"model": "m"}], "decode": [{"model": "m"}]}
    )
    env = up.engine_environment(single.prefill[0], single)
    assert (env["VLLM_HOST_IP"], env["UCX_NET_DEVICES"]) == ("127.0.0.1", "lo")
    assert host_entry(single, single.prefill[0]) is None
    assert host_environment(None, {"A": "b"}) == {"A": "b"}


def test_a_wildcard_proxy_on_one_host_gets_a_generated_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: set, then removed: monkeypatch restores "absent" at teardown, so a
    # secret with_secret generates does not leak into the other tests.
    monkeypatch.setenv(SECRET_ENV, "placeholder")
    monkeypatch.delenv(SECRET_ENV)
    base = {"workdir": str(tmp_path), "prefill": [{"model": "m"}], "decode": [{"model": "m"}]}
    stale = tmp_path / "run" / "secret"
    stale.parent.mkdir()
    stale.write_text("an old world-readable file\n")
    stale.chmod(0o644)
    loopback = parse_topology(base)
    assert not needs_secret(loopback) and with_secret(loopback, print) is loopback
    told: list[str] = []
    exposed = parse_topology({**base, "proxy": {"host": "0.0.0.0"}})
    secured = with_secret(exposed, told.append)
    secret = os.environ[SECRET_ENV]
    assert len(secret) == 64 and secured.connector.secret() == secret
    path = tmp_path / "run" / "secret"
    assert path.read_text().strip() == secret and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["secret"]  # no temporary file left
    assert str(path) in told[0]
    extra = up.kv_transfer_config(up.resolve_ports(secured).prefill[0], secured.connector)[
        "kv_connector_extra_config"
    ]
    assert extra["secret_env"] == SECRET_ENV
    assert "--secret-env" in up.store_command(parse_topology({**base, "store": {}}).store, secured)  # type: ignore[arg-type]
    # The operator's own: taken, not replaced, and never generated over a named one.
    monkeypatch.setenv(SECRET_ENV, "operators")
    assert with_secret(exposed, told.append).connector.secret() == "operators"
    named = parse_topology({**base, "proxy": {"host": "0.0.0.0"}, "connector": {"secret_env": "S"}})
    assert not needs_secret(named)
    assert not needs_secret(
        parse_topology({**base, "proxy": {"host": "0.0.0.0"}, "connector": {"insecure": True}})
    )


def run_cli(
    args: list[str], tmp_path: Path, data: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k != SECRET_VAR}
    return subprocess.run(
        [sys.executable, "-m", "fabric.cli", *args, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def test_fabric_up_across_hosts_refuses_to_start_without_a_secret_or_a_host(tmp_path: Path) -> None:
    done = run_cli(["up"], tmp_path, topology(connector={}))
    assert done.returncode == 2, done.stderr
    assert (
        "fabric up: t.yaml" not in done.stderr
        and "connector.secret_env: a topology across hosts" in done.stderr
    )
    done = run_cli(["up"], tmp_path, topology())
    assert done.returncode == 2, done.stderr
    assert "run fabric up --host NAME on each" in done.stderr
    done = run_cli(["up", "--host", "hostq"], tmp_path, topology())
    assert done.returncode == 2 and "--host 'hostq': none of hosts" in done.stderr, done.stderr


# --- fabric up --host in three simulated hosts --------------------------------------------


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with hosts_or_skip(["hostp", "hostd", "hostx"]) as made:
        yield made


def test_fabric_up_on_each_host_serves_a_request_across_them(
    hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_VAR, "a-secret-every-host-holds")
    engine = [*FAKE, "--host", "{host}"]
    config: dict[str, Any] = {
        "hosts": {name: {"address": hosts.address(name)} for name in ("hostp", "hostd", "hostx")},
        "connector": {"secret_env": SECRET_VAR},
    }
    prefill = [{"host": "hostp", "port": 8100, "kv_port": 8101, "command": engine}]
    decode = [{"host": "hostd", "port": 8100, "kv_port": 8101, "command": engine}]
    runs: list[UpRun] = []
    try:
        for name in ("hostp", "hostd", "hostx"):
            workdir = tmp_path / name
            workdir.mkdir()
            runs.append(
                UpRun(
                    workdir,
                    prefill,
                    decode,
                    proxy={"host": "hostx", "port": 8000, "health_interval_s": 0.5},
                    args=["--host", name],
                    wrap=lambda argv, name=name: hosts.command(name, argv),  # type: ignore[misc]
                    **config,
                )
            )
        p_run, d_run, x_run = runs
        for run, name in ((p_run, "hostp"), (d_run, "hostd")):
            run.wait_line(rf"fabric up: {name}: serving \(the proxy: http://10\.77\.0\.4:8000")
        assert x_run.wait_serving() == "http://10.77.0.4:8000"
        state = d_run.state()
        assert state["host"] == "hostd" and state["proxy_url"] == "http://10.77.0.4:8000"
        assert [e["name"] for e in state["engines"]] == ["decode-0"]
        assert state["engines"][0]["url"] == "http://10.77.0.3:8100"
        x_engines = {e["name"]: e for e in x_run.state()["engines"]}
        assert x_engines["prefill-0"]["pid"] is None and x_engines["decode-0"]["pid"] is None
        answer = _post_in(hosts, "hostx", "http://10.77.0.4:8000/v1/completions")
        assert answer["status"] == 200, answer
        prefill_seen = _get_in(hosts, "hostp", "http://10.77.0.2:8100/fake/requests")
        decode_params = prefill_seen[-1]["body"]["kv_transfer_params"]
        assert decode_params["decode_kv_endpoint"] == "tcp://10.77.0.3:8101"
        for run in runs:
            assert run.stop() == 0, "".join(run.stderr)
            assert not run.leftovers()
    finally:
        for run in runs:
            run.kill_all()


def _python_in(hosts: Hosts, name: str, code: str) -> Any:
    done = subprocess.run(
        hosts.command(name, [sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _post_in(hosts: Hosts, name: str, url: str) -> Any:
    code = (
        "import httpx, json\n"
        "body = {'model': 'fake', 'prompt': 'hi', 'max_tokens': 3}\n"
        f"r = httpx.post({url!r}, json=body, timeout=30)\n"
        "print(json.dumps({'status': r.status_code, 'body': r.text}))\n"
    )
    return _python_in(hosts, name, code)


def _get_in(hosts: Hosts, name: str, url: str) -> Any:
    code = f"import httpx, json\nprint(json.dumps(httpx.get({url!r}, timeout=30).json()))\n"
    return _python_in(hosts, name, code)


_ = TopologyConfig  # re-exported type for readers of the fixtures above
