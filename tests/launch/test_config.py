"""Topology YAML: the shipped configs load, and every mistake names its file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabric.config import TopologyConfig, load_topology, parse_topology
from fabric.errors import ConfigError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))

GOOD = """\
model: tiny
workdir: w
prefill:
  - {cpu_cores: "0", env: {FOO: 1, BAR: true}}
decode:
  - {name: d, port: 8200, kv_port: 8201, args: ["--max-model-len", "2048"]}
  - {url: "http://10.0.0.7:8000/", kv_port: 9000, role: both}
connector: {store_slots: 64, pool_device: pinned, load_timeout_s: 5, extra: {pack_threads: 2}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path: Path) -> None:
    topology = load_topology(path)
    assert topology.prefill and topology.decode


def test_good_yaml_fills_defaults_from_the_list_and_the_top(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, GOOD))

    [p] = topology.prefill
    d, remote = topology.decode
    assert (p.name, p.role, p.model, p.env) == (
        "prefill-0",
        "prefill",
        "tiny",
        {"FOO": "1", "BAR": "1"},
    )
    assert (d.name, d.role, d.base_url, d.kv_endpoint) == (
        "d",
        "decode",
        "http://127.0.0.1:8200",
        "tcp://127.0.0.1:8201",
    )
    assert (remote.model, remote.base_url, remote.kv_role) == (
        None,
        "http://10.0.0.7:8000",
        "kv_both",
    )
    assert remote.kv_endpoint == "tcp://10.0.0.7:9000"
    assert topology.proxy.port == 8000 and topology.proxy.policy == "round_robin"
    assert topology.connector.extra_config(8201) == {
        "kv_port": 8201,
        "host": "127.0.0.1",
        "chunk_tokens": 256,
        "transport": "auto",
        "reuse": True,
        "store_slots": 64,
        "pool_device": "pinned",
        "load_timeout_s": 5.0,
        "pack_threads": 2,
    }


@pytest.mark.parametrize(
    ("reuse", "expect"),
    [
        ("all", {"prefill": True, "decode": True, "both": True}),
        ("prefill", {"prefill": True, "decode": False, "both": True}),
        ("decode", {"prefill": False, "decode": True, "both": True}),
        ("none", {"prefill": False, "decode": False, "both": False}),
    ],
)
def test_reuse_roles_and_per_engine_disk_dirs(
    tmp_path: Path, reuse: str, expect: dict[str, bool]
) -> None:
    data = {
        "model": "tiny",
        "prefill": [{}],
        "decode": [{}],
        "connector": {"reuse": reuse, "disk_path": str(tmp_path / "kv"), "disk_gib": 2},
    }
    connector = parse_topology(data).connector
    for role, wanted in expect.items():
        extra = connector.extra_config(9000, role=role, name=f"{role}-0")  # type: ignore[arg-type]
        assert extra["reuse"] is wanted
        assert extra.get("disk_path") == (str(tmp_path / "kv" / f"{role}-0") if wanted else None)
        assert extra["disk_gib"] == 2


def test_bad_reuse_settings_name_the_field() -> None:
    for connector, field in (
        ({"reuse": "sometimes"}, "connector.reuse"),
        ({"disk_gib": 0}, "connector.disk_gib"),
        ({"eviction": "lfu"}, "connector.eviction"),
    ):
        with pytest.raises(ConfigError, match=field):
            parse_topology({"model": "tiny", "decode": [{}], "connector": connector})


def test_config_is_frozen(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, GOOD))
    with pytest.raises(ValueError):
        topology.decode[0].port = 1


BAD = [
    (
        "decode: [{port: x}]\nprefill: [{}]\nmodel: m",
        "decode[0].port: Input should be a valid integer",
    ),
    (
        "decode: [{port: 70000}]\nprefill: [{}]\nmodel: m",
        "decode[0].port: Input should be less than or equal to 65535",
    ),
    (
        "decode: [{prot: 1}]\nprefill: [{}]\nmodel: m",
        "decode[0].prot: Extra inputs are not permitted",
    ),
    (
        "decode: [{}]\nprefill: [{}]\nmodel: m\nproxy: {policy: random}",
        "proxy.policy: Input should be 'round_robin'",
    ),
    (
        "decode: [{}]\nprefill: [{}]",
        "prefill[0]: give url (a running engine) or model (to start one)",
    ),
    (
        "decode: [{url: 'http://h:1', model: m}]\nprefill: [{}]\nmodel: m",
        "decode[0]: give either url",
    ),
    (
        "decode: [{url: 'h:1'}]\nprefill: [{}]\nmodel: m",
        "decode[0].url: 'h:1' is not an http(s) URL",
    ),
    ("decode: []\nprefill: [{}]\nmodel: m", "decode: at least one decode engine is needed"),
    ("decode: [{}]\nmodel: m", "prefill: Field required"),
    (
        "decode: [{name: a}]\nprefill: [{name: a}]\nmodel: m",
        "decode[0].name: 'a' is also the name of prefill[0]",
    ),
    (
        "decode: [{port: 9000}]\nprefill: [{kv_port: 9000}]\nmodel: m",
        "decode[0].port: port 9000 is already used by prefill[0].kv_port",
    ),
    (
        "decode: [{port: 8000}]\nprefill: [{}]\nmodel: m",
        "decode[0].port: port 8000 is already used by proxy.port",
    ),
    (
        "decode: [{role: prefill}]\nprefill: [{}]\nmodel: m",
        "decode[0].role: 'prefill' engine in the decode list",
    ),
    (
        "decode: [{}]\nprefill: [{}]\nmodel: m\nconnector: {store_mib: 1, store_slots: 1}",
        "connector: give store_slots or store_mib, not both",
    ),
    (
        "decode: [{}]\nprefill: [{}]\nmodel: m\nconnector: {transport: ucx}",
        "connector.transport: Input should be 'auto', 'nixl' or 'tcp'",
    ),
    (
        "decode: [{}]\nprefill: [{}]\nmodel: m\nconnector: {chunk_tokens: 0}",
        "connector.chunk_tokens: Input should be greater than 0",
    ),
    (
        "decode: [{env: {A: [1]}}]\nprefill: [{}]\nmodel: m",
        "decode[0].env.A: Input should be a valid string",
    ),
    ("- a\n- b", "the top level must be a mapping, got list"),
    ("decode: [", "invalid YAML"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_yaml_names_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_topology(tmp_path / "nope.yaml")


def test_every_error_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_topology(write(tmp_path, "decode: [{port: x, kv_port: y}]\nprefill: [{}]\nmodel: m"))
    assert str(info.value).splitlines() == [
        f"{tmp_path / 'topology.yaml'}: decode[0].port: Input should be a valid integer",
        f"{tmp_path / 'topology.yaml'}: decode[0].kv_port: Input should be a valid integer",
    ]


def test_parse_topology_takes_a_dict() -> None:
    topology = parse_topology({"model": "m", "prefill": [{}], "decode": [{}]}, source="x")
    assert isinstance(topology, TopologyConfig)
    assert [e.name for e in topology.engines] == ["prefill-0", "decode-0"]
    assert topology.prefill[0].kv_role == "kv_producer"
    assert topology.decode[0].kv_role == "kv_consumer"


def test_store_section_validates_and_reaches_every_reuse_engine(tmp_path: Path) -> None:
    text = GOOD + "store: {port: 0, mem_gib: 0.5, disk_path: kv-shared, disk_gib: 2}\n"
    topology = load_topology(write(tmp_path, text))
    assert topology.store is not None
    assert (topology.store.mem_gib, topology.store.disk_gib) == (0.5, 2.0)
    assert load_topology(write(tmp_path, GOOD)).store is None
    from fabric.launch.up import store_command, with_shared_store

    command = store_command(topology.store, topology)
    assert command[2:5] == ["fabric.cli", "store", "serve"]
    assert command[command.index("--disk-path") + 1] == str((Path("kv-shared")).resolve())
    shared = with_shared_store(topology, "tcp://127.0.0.1:7000")
    extra = shared.connector.extra_config(8101, role="prefill", name="p")
    assert extra["shared_store"] == "tcp://127.0.0.1:7000"
    no_reuse = shared.model_copy(
        update={"connector": shared.connector.model_copy(update={"reuse": "decode"})}
    )
    assert "shared_store" not in no_reuse.connector.extra_config(8101, role="prefill")


@pytest.mark.parametrize("reuse", ["prefill", "decode", "all"])
def test_with_a_shared_store_every_engine_keeps_its_pool_in_host_memory(
    tmp_path: Path, reuse: str
) -> None:
    """auto would put a pool in VRAM on an engine without a reuse tier (no
    shared store there) and in host memory on one with: they would refuse
    each other's Hello. So the topology gives every engine host."""
    from fabric.launch.up import with_shared_store

    text = (
        "model: tiny\nprefill: [{}]\ndecode: [{}]\nstore: {}\n" + f"connector: {{reuse: {reuse}}}\n"
    )
    topology = with_shared_store(load_topology(write(tmp_path, text)), "/tmp/store.endpoint")
    for role in ("prefill", "decode"):
        extra = topology.connector.extra_config(9000, role=role)  # type: ignore[arg-type]
        assert extra["pool_device"] == "host", role
    plain = load_topology(write(tmp_path, "model: tiny\nprefill: [{}]\ndecode: [{}]\n"))
    assert "pool_device" not in plain.connector.extra_config(9000, role="prefill")


def test_connector_insecure_reaches_the_engines_and_the_store(tmp_path: Path) -> None:
    from fabric.launch.up import store_command

    store = "store: {port: 0, mem_gib: 0.5}\n"
    plain = load_topology(write(tmp_path, GOOD + store))
    assert plain.store is not None
    assert "insecure" not in plain.connector.extra_config(8101)
    assert "--insecure" not in store_command(plain.store, plain)
    topology = load_topology(write(tmp_path, GOOD + store + "connector: {insecure: true}\n"))
    assert topology.store is not None
    assert topology.connector.extra_config(8101)["insecure"] is True
    assert "--insecure" in store_command(topology.store, topology)
    with pytest.raises(ConfigError, match=r"connector\.insecure: Input should be a valid boolean"):
        load_topology(write(tmp_path, GOOD + "connector: {insecure: perhaps}\n"))


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ("store: {mem_gib: 0}", "store.mem_gib: Input should be greater than 0"),
        ("store: {memory: 2}", "store.memory: Extra inputs are not permitted"),
        ("store: {port: 70000}", "store.port: Input should be less than or equal to 65535"),
        ("store: {disk_gib: -1}", "store.disk_gib: Input should be greater than 0"),
        (
            "store: {}\nconnector: {reuse: none}",
            "store: a shared store needs engines with a reuse tier",
        ),
        (
            "store: {}\nconnector: {pool_device: cuda}",
            "store: a shared store keeps chunks in host memory, and connector.pool_device",
        ),
        (
            "connector: {pool_device: cuda, shared_store: '127.0.0.1:5'}",
            "connector: pool_device: 'cuda' with a shared store or the tcp transport",
        ),
    ],
)
def test_bad_store_section_names_the_field(tmp_path: Path, store: str, message: str) -> None:
    text = "model: tiny\nprefill: [{}]\ndecode: [{}]\n" + store + "\n"
    with pytest.raises(ConfigError) as info:
        load_topology(write(tmp_path, text))
    assert message in str(info.value)
    assert str(tmp_path / "topology.yaml") in str(info.value)
