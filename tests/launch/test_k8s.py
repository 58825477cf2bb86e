"""``fabric k8s``: manifests valid against the Kubernetes schema, and saying what fabric means."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from fabric.cli import main as cli_main
from fabric.config import TopologyConfig, load_topology, parse_topology
from fabric.errors import ConfigError
from fabric.launch.k8s import K8sOptions, render, render_yaml
from fabric.router.admin import check_admin_exposure
from tests.launch._k8s import stub_api_server, validate

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def topology(**extra: Any) -> TopologyConfig:
    """A tiny 1P1D topology with ``extra`` top-level keys."""
    return parse_topology({"model": "tiny", "prefill": [{}], "decode": [{}], **extra})


def find(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered"
    return matches[0]


def pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(spec: dict[str, Any], name: str = "engine") -> dict[str, Any]:
    return next(c for c in spec["containers"] if c["name"] == name)


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def kv_config(c: dict[str, Any]) -> dict[str, Any]:
    command = c["command"]
    config: dict[str, Any] = json.loads(command[command.index("--kv-transfer-config") + 1])
    return config


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_renders_valid_manifests(path: Path) -> None:
    documents = list(yaml.safe_load_all(render_yaml(load_topology(path))))
    kinds = [d["kind"] for d in documents]
    assert kinds.count("ConfigMap") == 1 and kinds[-2:] == ["Service", "Deployment"]
    for document in documents:
        validate(document)
    for document in documents:
        if document["kind"] != "Deployment" or document["metadata"]["name"] == "fabric-proxy":
            continue
        engine = container(pod(document))
        extra = kv_config(engine)["kv_connector_extra_config"]
        assert extra["host"] == "0.0.0.0" and "advertise_host" not in extra
        assert engine["command"][engine["command"].index("--host") + 1] == "0.0.0.0"


def test_the_validator_refuses_a_wrong_field() -> None:
    deployment = find(render(topology()), "Deployment", "fabric-decode-0")
    wrong = copy.deepcopy(deployment)
    container(pod(wrong))["imagePullPolicy"] = {"not": "a string"}
    with pytest.raises(jsonschema.ValidationError):
        validate(wrong)
    unknown = copy.deepcopy(deployment)
    container(pod(unknown))["readinesProbe"] = {"tcpSocket": {"port": 8100}}
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        validate(unknown)


def test_engine_runs_fabric_ups_command_bound_to_the_pod() -> None:
    documents = render(load_topology(REPO / "configs/1p1d.yaml"))
    for name, role in (("prefill-0", "kv_producer"), ("decode-0", "kv_consumer")):
        spec = pod(find(documents, "Deployment", f"fabric-{name}"))
        engine = container(spec)
        command = engine["command"]
        assert command[:3] == ["python3", "-m", "fabric.launch.vllm_main"]
        assert command[command.index("--host") + 1] == "0.0.0.0"
        assert command[command.index("--port") + 1] == "8100"
        config = kv_config(engine)
        assert config["kv_role"] == role
        extra = config["kv_connector_extra_config"]
        assert (extra["host"], extra["kv_port"], extra["secret_env"]) == (
            "0.0.0.0",
            8101,
            "FABRIC_SECRET",
        )
        assert "advertise_host" not in extra
        variables = env(engine)
        assert variables["VLLM_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert "UCX_NET_DEVICES" not in variables and "CUDA_VISIBLE_DEVICES" not in variables
        # the tiny model: built by an initContainer where vLLM loads it, served as "tiny"
        (model,) = spec["initContainers"]
        assert model["command"][-1] == command[4] == "/fabric/models/tiny"
        assert command[command.index("--served-model-name") + 1] == "tiny"
    assert sys.executable not in render_yaml(load_topology(REPO / "configs/1p1d.yaml"))


def test_service_ports_are_the_engines_ports() -> None:
    decode = [{"name": "decode-0", "port": 8200, "kv_port": 8201}]
    documents = render(parse_topology({"model": "tiny", "prefill": [{}], "decode": decode}))
    for name, port, kv_port in (("prefill-0", 8100, 8101), ("decode-0", 8200, 8201)):
        service = find(documents, "Service", f"fabric-{name}")
        ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
        assert ports == {"http": (port, "http"), "kv": (kv_port, "kv")}
        engine = container(pod(find(documents, "Deployment", f"fabric-{name}")))
        assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {
            "http": port,
            "kv": kv_port,
        }
        assert kv_config(engine)["kv_connector_extra_config"]["kv_port"] == kv_port
        template = find(documents, "Deployment", f"fabric-{name}")["spec"]["template"]
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()


def test_proxy_topology_names_every_engine_by_its_service(monkeypatch: pytest.MonkeyPatch) -> None:
    documents = render(load_topology(REPO / "configs/2p2d.yaml"))
    config_map = find(documents, "ConfigMap", "fabric-topology")
    served = parse_topology(yaml.safe_load(config_map["data"]["topology.yaml"]))
    urls = {e.name: (e.url, e.kv_port) for e in served.engines}
    assert urls == {
        name: (f"http://fabric-{name}:8100", 8101)
        for name in ("prefill-0", "prefill-1", "decode-0", "decode-1")
    }
    for name in urls:
        find(documents, "Service", f"fabric-{name}")
    assert (served.proxy.host, served.proxy.port) == ("0.0.0.0", 8000)
    monkeypatch.setenv("FABRIC_SECRET", "s3cret")
    check_admin_exposure(
        served, served.proxy.host
    )  # the proxy pod starts: admin routes have a token
    proxy = container(pod(find(documents, "Deployment", "fabric-proxy")), "proxy")
    assert proxy["command"][-1] == "/etc/fabric/topology.yaml"
    assert env(proxy)["FABRIC_SECRET"] == {
        "secretKeyRef": {"name": "fabric-secret", "key": "secret"}
    }


def test_probes_answer_on_health() -> None:
    documents = render(topology())
    proxy = container(pod(find(documents, "Deployment", "fabric-proxy")), "proxy")
    # NOTE: plain /health is 503 while any engine is down: the Service would
    # lose every proxy when one engine restarts. ?serving=1: a decoder is routable.
    ready = proxy["readinessProbe"]
    assert ready["httpGet"] == {"path": "/health?serving=1", "port": "http"}
    assert ready["failureThreshold"] >= 3
    # NOTE: it answers after probing every engine: a partitioned one takes the
    # health timeout (2 s) and a fresh connect (3 s), past the kubelet's default 5 s
    assert ready["timeoutSeconds"] >= 2 + 3 + 1
    # NOTE: /health is 503 while the proxy waits for engines; liveness must not kill it then.
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/metrics"
    engine = container(pod(find(documents, "Deployment", "fabric-decode-0")))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # a draining engine (503 on /health) outlives its drain before liveness gives up
    live = engine["livenessProbe"]
    grace = pod(find(documents, "Deployment", "fabric-decode-0"))["terminationGracePeriodSeconds"]
    assert live["periodSeconds"] * live["failureThreshold"] > grace
    annotations = find(documents, "Deployment", "fabric-proxy")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert (
        annotations["prometheus.io/scrape"] == "true"
        and annotations["prometheus.io/port"] == "8000"
    )


def test_gpus_from_cuda_visible_devices_and_tp_ranks_get_kv_ports() -> None:
    documents = render(load_topology(REPO / "configs/2p2d-gpu-tp.yaml"))
    engine = container(pod(find(documents, "Deployment", "fabric-decode-1")))
    assert engine["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert "CUDA_VISIBLE_DEVICES" not in env(engine)
    ports = find(documents, "Service", "fabric-decode-1")["spec"]["ports"]
    assert [(p["name"], p["port"]) for p in ports] == [("http", 8100), ("kv", 8101), ("kv-1", 8102)]


def test_resources_rdma_and_placement() -> None:
    k8s = {
        "gpu_resource": "amd.com/gpu",
        "rdma_resource": "rdma/hca_shared_devices_a",
        "engine": {
            "cpu": 8,
            "memory": "64Gi",
            "gpus": 1,
            "rdma": 1,
            "node_selector": {"pool": "gpu"},
        },
        "engines": {"decode-0": {"gpus": 2}},
        "proxy": {"cpu": "500m", "replicas": 2, "service_type": "LoadBalancer"},
    }
    documents = render(topology(k8s=k8s))
    for document in documents:
        validate(document)
    prefill = pod(find(documents, "Deployment", "fabric-prefill-0"))
    decode = pod(find(documents, "Deployment", "fabric-decode-0"))
    assert container(prefill)["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "64Gi", "amd.com/gpu": 1, "rdma/hca_shared_devices_a": 1},
    }
    assert container(decode)["resources"]["limits"]["amd.com/gpu"] == 2
    assert container(decode)["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert decode["nodeSelector"] == {"pool": "gpu"}
    assert find(documents, "Deployment", "fabric-proxy")["spec"]["replicas"] == 2
    assert find(documents, "Service", "fabric-proxy")["spec"]["type"] == "LoadBalancer"


def test_secret_is_never_inline_unless_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_SECRET", "value-that-must-not-leak")
    text = render_yaml(topology())
    assert "value-that-must-not-leak" not in text
    assert "kind: Secret" not in text and "secretKeyRef" in text
    documents = render(topology(), K8sOptions(secret="passed-on-purpose"))
    secret = find(documents, "Secret", "fabric-secret")
    assert secret["stringData"] == {"secret": "passed-on-purpose"}
    validate(secret)


def test_secret_from_env_holds_the_admin_token_in_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "topology.yaml"
    data = {"model": "tiny", "prefill": [{}], "decode": [{}]}
    config.write_text(yaml.safe_dump(data | {"proxy": {"admin_token_env": "ADMIN"}}))
    out = tmp_path / "fabric.yaml"
    out.write_text("old")
    out.chmod(0o644)  # an older output: its mode must not stay
    monkeypatch.setenv("CONNECTOR_SECRET", "s3cret")
    monkeypatch.setenv("ADMIN", "t0ken\n")  # as read from a file
    argv = ["k8s", str(config), "-o", str(out), "--secret-from-env", "CONNECTOR_SECRET"]

    assert cli_main(argv) == 0

    assert out.stat().st_mode & 0o777 == 0o600
    documents = list(yaml.safe_load_all(out.read_text()))
    secret = find(documents, "Secret", "fabric-secret")
    assert secret["stringData"] == {"secret": "s3cret", "admin-token": "t0ken"}
    proxy = container(pod(find(documents, "Deployment", "fabric-proxy")), "proxy")
    for ref in (v["secretKeyRef"] for v in env(proxy).values() if "secretKeyRef" in v):
        assert ref["name"] == "fabric-secret" and ref["key"] in secret["stringData"]
    assert env(proxy)["ADMIN"] == {"secretKeyRef": {"name": "fabric-secret", "key": "admin-token"}}
    assert {p.name for p in tmp_path.iterdir()} == {"topology.yaml", "fabric.yaml"}  # no temp

    monkeypatch.delenv("ADMIN")
    assert cli_main(argv) == 2
    assert "ADMIN" in capsys.readouterr().err
    options = K8sOptions(secret="s3cret")
    with pytest.raises(ConfigError, match=r"proxy\.admin_token_env"):
        render(topology(proxy={"admin_token_env": "ADMIN"}), options)


def test_cli_output_without_a_secret_value_is_written_as_before(tmp_path: Path) -> None:
    out = tmp_path / "fabric.yaml"
    assert cli_main(["k8s", str(REPO / "configs/1p1d.yaml"), "-o", str(out)]) == 0
    assert "kind: Secret" not in out.read_text()


def test_command_engine_listens_on_every_interface_and_advertises_the_pod() -> None:
    command = [
        "my-server",
        "--host={host}",
        "--advertise",
        "{address}",
        "--port",
        "{port}",
        "--kv-transfer-config",
        "{kv_transfer_config}",
    ]
    engines = [{"name": "p", "command": command}, {"name": "d", "command": command}]
    documents = render(parse_topology({"prefill": engines[:1], "decode": engines[1:]}))
    for document in documents:
        validate(document)
    engine = container(pod(find(documents, "Deployment", "fabric-d")))
    argv = engine["command"]
    assert argv[:2] == ["my-server", "--host=0.0.0.0"]
    # NOTE: Kubernetes expands $(VAR) in a container's command from its env
    assert argv[argv.index("--advertise") + 1] == "$(VLLM_HOST_IP)"
    assert "VLLM_HOST_IP" in env(engine) and "127.0.0.1" not in json.dumps(argv)
    extra = kv_config(engine)["kv_connector_extra_config"]
    assert extra["host"] == "0.0.0.0" and "advertise_host" not in extra


def test_insecure_topology_has_no_secret() -> None:
    documents = render(topology(connector={"insecure": True}))
    assert "secretKeyRef" not in json.dumps(documents)
    extra = kv_config(container(pod(find(documents, "Deployment", "fabric-decode-0"))))
    assert extra["kv_connector_extra_config"]["insecure"] is True


def test_engine_spanning_pods_is_a_leader_worker_set() -> None:
    documents = render(topology(k8s={"engines": {"decode-0": {"pods_per_engine": 2, "gpus": 8}}}))
    for document in documents:
        validate(document)
    lws = find(documents, "LeaderWorkerSet", "fabric-decode-0")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    leader = container(group["leaderTemplate"]["spec"])["command"]
    worker = container(group["workerTemplate"]["spec"])["command"]
    assert leader[leader.index("--node-rank") + 1] == "0" and "--headless" not in leader
    assert (
        worker[worker.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)" and "--headless" in worker
    )
    for spec in (group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]):
        assert [c["name"] for c in spec["initContainers"]] == ["model"]  # both load weights
    for command in (leader, worker):
        assert command[command.index("--nnodes") + 1] == "2"
        assert command[command.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
    selector = find(documents, "Service", "fabric-decode-0")["spec"]["selector"]
    assert selector.items() <= group["leaderTemplate"]["metadata"]["labels"].items()
    assert not selector.items() <= group["workerTemplate"]["metadata"]["labels"].items()
    wrong = copy.deepcopy(lws)
    group = wrong["spec"]["leaderWorkerTemplate"]
    group["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        validate(wrong)
    group["restartPolicy"] = "None"
    group["workerTemplate"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(jsonschema.ValidationError, match="bogus"):
        validate(wrong)


def test_overrides_are_deep_merged() -> None:
    overrides = {
        "Deployment/fabric-decode-0": {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "engine",
                                "image": "registry/fabric:1",
                                "env": [{"name": "X", "value": "1"}],
                            }
                        ],
                        "terminationGracePeriodSeconds": None,
                    }
                }
            }
        },
        "Service/fabric-proxy": {"metadata": {"annotations": {"team": "llm"}}},
    }
    documents = render(topology(k8s={"overrides": overrides}))
    spec = pod(find(documents, "Deployment", "fabric-decode-0"))
    engine = container(spec)
    assert engine["image"] == "registry/fabric:1" and env(engine)["X"] == "1"
    assert env(engine)["VLLM_HOST_IP"]  # merged by name: the rendered entries stay
    assert "terminationGracePeriodSeconds" not in spec
    assert (
        container(pod(find(documents, "Deployment", "fabric-prefill-0")))["image"]
        == "fabric:latest"
    )
    assert find(documents, "Service", "fabric-proxy")["metadata"]["annotations"] == {"team": "llm"}
    with pytest.raises(ConfigError, match=r"k8s\.overrides\.Deployment/fabric-nope"):
        render(topology(k8s={"overrides": {"Deployment/fabric-nope": {}}}))


def test_shared_store_is_a_sidecar_in_each_engine_pod() -> None:
    documents = render(
        topology(store={"mem_gib": 1, "disk_path": "shared"}, connector={"disk_path": "kv"})
    )
    for document in documents:
        validate(document)
    spec = pod(find(documents, "Deployment", "fabric-decode-0"))
    store = next(c for c in spec["initContainers"] if c["name"] == "store")
    assert store["restartPolicy"] == "Always"
    assert store["command"][:5] == ["python3", "-m", "fabric.cli", "store", "serve"]
    assert store["command"][store.get("command").index("--disk-path") + 1] == "/fabric/shared"
    endpoint = store["command"][store["command"].index("--endpoint-file") + 1]
    assert store["startupProbe"]["exec"]["command"] == ["test", "-s", endpoint]
    extra = kv_config(container(spec))["kv_connector_extra_config"]
    assert extra["shared_store"] == endpoint
    assert extra["disk_path"] == "/fabric/kv/decode-0"
    served = yaml.safe_load(
        find(documents, "ConfigMap", "fabric-topology")["data"]["topology.yaml"]
    )
    assert "shared_store" not in served["connector"] and "store" not in served


def test_what_a_cluster_cannot_run_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"k8s\.engines\.decode-9"):
        render(topology(k8s={"engines": {"decode-9": {"gpus": 1}}}))
    with pytest.raises(ConfigError, match=r"k8s\.engines\.decode-0\.pods_per_engine"):
        render(topology(store={}, k8s={"engines": {"decode-0": {"pods_per_engine": 2}}}))
    with pytest.raises(ConfigError, match=r"k8s\.engine\.memory"):
        topology(k8s={"engine": {"memory": "lots"}})
    with pytest.raises(ConfigError, match=r"k8s\.bogus"):
        topology(k8s={"bogus": 1})
    with pytest.raises(ConfigError, match=r"decode\[0\]\.name: 'fabric-proxy'"):
        render(parse_topology({"model": "tiny", "prefill": [{}], "decode": [{"name": "proxy"}]}))


def test_running_engines_are_kept_as_urls() -> None:
    decode = [{"name": "remote", "url": "http://10.0.0.7:8000", "kv_port": 9000}]
    documents = render(parse_topology({"model": "tiny", "prefill": [{}], "decode": decode}))
    assert not [d for d in documents if "remote" in d["metadata"]["name"]]
    served = yaml.safe_load(
        find(documents, "ConfigMap", "fabric-topology")["data"]["topology.yaml"]
    )
    assert served["decode"] == [
        {"name": "remote", "role": "decode", "url": "http://10.0.0.7:8000", "kv_port": 9000}
    ]


def test_cli_writes_the_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fabric.yaml"
    config = str(REPO / "configs/1p1d.yaml")
    assert (
        cli_main(["k8s", config, "-o", str(out), "--namespace", "llm", "--image", "reg/fabric:2"])
        == 0
    )
    documents = list(yaml.safe_load_all(out.read_text()))
    assert {d["metadata"]["namespace"] for d in documents} == {"llm"}
    images = {
        c["image"] for d in documents if d["kind"] == "Deployment" for c in pod(d)["containers"]
    }
    assert images == {"reg/fabric:2"}
    assert cli_main(["k8s", config, "--namespace", "Not_A_Label"]) == 2
    assert "--namespace" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_dry_run_accepts_every_config(tmp_path: Path) -> None:
    texts = [render_yaml(load_topology(path)) for path in CONFIGS]
    texts.append(render_yaml(topology(k8s={"engines": {"decode-0": {"pods_per_engine": 2}}})))
    with stub_api_server(tmp_path) as kubeconfig:
        environ = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)}

        def apply(text: str) -> subprocess.CompletedProcess[str]:
            argv = ["kubectl", "apply", "--dry-run=client", "--validate=false", "-f", "-"]
            return subprocess.run(
                argv, input=text, env=environ, capture_output=True, text=True, timeout=60
            )

        for text in texts:
            done = apply(text)
            assert done.returncode == 0, done.stderr
            assert done.stdout.count("created (dry run)") == text.count("\nkind: ")
        refused = apply(texts[0].replace("kind: Deployment", "kind: Deploymnet", 1))
        assert refused.returncode != 0 and "Deploymnet" in refused.stderr
