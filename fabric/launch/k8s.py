"""``fabric k8s TOPOLOGY``: the Kubernetes manifests of a topology, from the same YAML.

::

    Secret     <secret_name>          only with --secret-from-env (else it must exist):
                                      the secret, and the admin token when
                                      proxy.admin_token_env names one
    ConfigMap  <name>-topology        the proxy's topology: every engine by its
                                      Service (url: http://<name>-ENGINE:PORT, kv_port)
    per launched engine:
      Service    <name>-ENGINE        ports http, kv (kv-1.. for TP ranks)
      Deployment <name>-ENGINE        one pod (LeaderWorkerSet when it spans pods),
                                      see :mod:`fabric.launch.k8s_engines`
    Service    <name>-proxy           port http
    Deployment <name>-proxy           fabric proxy /etc/fabric/topology.yaml;
                                      readiness GET /health?serving=1 (a decoder
                                      can be routed to: not every engine is up),
                                      liveness GET /metrics (answers while the
                                      proxy waits for engines)

Then each ``k8s.overrides`` entry is deep-merged into the object it names.
The topology is adapted first (:mod:`fabric.launch.k8s_plan`: fixed ports,
the secret, paths in the pod). The secret's value (and the admin token's)
is in the output only when ``--secret-from-env`` passes it; ``-o FILE`` then
writes a file only its owner can read.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from fabric.config import (
    EngineConfig,
    ProxyConfig,
    TopologyConfig,
    load_topology,
    parse_topology,
)
from fabric.errors import ConfigError
from fabric.launch import k8s_objects as objects
from fabric.launch.k8s_engines import engine_documents, secret_entries
from fabric.launch.k8s_objects import Manifest
from fabric.launch.k8s_plan import WILDCARD, K8sOptions, K8sPlan, launched_engines, plan
from fabric.launch.secret import write_private
from fabric.router.admin import admin_token
from fabric.router.engines import UNREACHABLE_CONNECT_S

# NOTE: plain /health is 503 while any engine is down or any pair unchecked:
# as readiness it would take every proxy out of the Service when one engine restarts.
PROXY_READINESS = "/health?serving=1"

TOPOLOGY_DIR = "/etc/fabric"
TOPOLOGY_FILE = "topology.yaml"


def render(topology: TopologyConfig, options: K8sOptions | None = None) -> list[Manifest]:
    """Every manifest of ``topology``, in the order ``kubectl apply`` takes them."""
    planned = plan(topology, options)
    documents = [] if planned.options.secret is None else [secret_manifest(planned)]
    config_map = topology_config_map(planned)
    documents.append(config_map)
    for _, engine in launched_engines(planned.topology):
        documents += engine_documents(planned, engine)
    documents += proxy_documents(planned, config_map)
    return objects.apply_overrides(documents, planned.settings.overrides)


def render_yaml(topology: TopologyConfig, options: K8sOptions | None = None) -> str:
    """:func:`render` as one multi-document YAML stream."""
    return dump_all(render(topology, options))


def proxy_topology(planned: K8sPlan) -> dict[str, Any]:
    """The topology the proxy pod serves: every engine by its Service's URL and
    ``kv_port`` (engines given by ``url`` as they are), listening on ``0.0.0.0``."""
    topology = planned.topology
    out: dict[str, Any] = {
        role: [_as_running(planned, engine) for engine in getattr(topology, role)]
        for role in ("prefill", "decode")
    }
    proxy = topology.proxy.model_dump(mode="json", exclude_defaults=True)
    out["proxy"] = proxy | {"host": WILDCARD, "port": planned.proxy_port}
    out["connector"] = topology.connector.model_dump(
        mode="json", exclude_defaults=True, exclude={"shared_store"}
    )
    out["startup_timeout_s"] = topology.startup_timeout_s
    return out


def _as_running(planned: K8sPlan, engine: EngineConfig) -> dict[str, Any]:
    if not engine.launched:
        running: dict[str, Any] = engine.model_dump(mode="json", exclude_defaults=True)
        return {"name": engine.name, "role": engine.role, **running}
    url = f"http://{planned.names[engine.name]}:{engine.port}"
    return {"name": engine.name, "role": engine.role, "url": url, "kv_port": engine.kv_port}


def topology_config_map(planned: K8sPlan) -> Manifest:
    """The ConfigMap holding :func:`proxy_topology` as ``topology.yaml``."""
    name = planned.object_name("topology")
    text = yaml.safe_dump(proxy_topology(planned), sort_keys=False)
    parse_topology(yaml.safe_load(text), source=f"ConfigMap {name}")  # NOTE: the proxy's own check
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": objects.metadata(
            name, planned.settings, objects.labels(planned.settings, name, "proxy")
        ),
        "data": {TOPOLOGY_FILE: text},
    }


def secret_manifest(planned: K8sPlan) -> Manifest:
    """The Secret holding the connector's secret (only when it was passed) and,
    when ``proxy.admin_token_env`` names one, the admin token (the proxy reads
    it from there): ConfigError when that token was not passed."""
    settings, options = planned.settings, planned.options
    assert options.secret is not None
    data = {settings.secret_key: options.secret}
    admin_env = planned.topology.proxy.admin_token_env
    if admin_env is not None:
        if options.admin_token is None:
            raise ConfigError(
                f"proxy.admin_token_env: the rendered Secret needs the admin token "
                f"(key {settings.admin_token_key!r}): set ${admin_env} when rendering"
            )
        if settings.admin_token_key == settings.secret_key:
            raise ConfigError(
                f"k8s.admin_token_key: {settings.admin_token_key!r} is also k8s.secret_key"
            )
        data[settings.admin_token_key] = options.admin_token
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": objects.metadata(settings.secret_name, settings),
        "type": "Opaque",
        "stringData": data,
    }


def readiness_timeout_s(proxy: ProxyConfig) -> int:
    """How long the kubelet waits for the proxy's readiness answer: the
    proxy probes every engine before it answers, a probe that times out
    tries a fresh connect (``fabric.router.engines``), and 2 s to spare.
    With 5 s (the default), one partitioned engine failed every probe and
    took each proxy replica out of the Service."""
    connect_s = max(proxy.health_timeout_s, UNREACHABLE_CONNECT_S)
    return math.ceil(proxy.health_timeout_s + connect_s) + 2


def proxy_documents(planned: K8sPlan, config_map: Manifest) -> list[Manifest]:
    """The proxy's Service and Deployment."""
    settings, pods = planned.settings, planned.settings.proxy
    name = planned.object_name("proxy")
    pod_labels = objects.labels(settings, name, "proxy")
    port = planned.proxy_port
    digest = hashlib.sha256(config_map["data"][TOPOLOGY_FILE].encode()).hexdigest()
    # NOTE: a changed topology changes the pod template, so the proxy rolls.
    annotations = objects.prometheus_annotations(settings, port) | {
        "fabric/topology-sha256": digest
    }
    argv = [settings.python, "-m", "fabric.cli", "proxy", f"{TOPOLOGY_DIR}/{TOPOLOGY_FILE}"]
    proxy = objects.container(
        "proxy",
        argv,
        settings,
        ports=[{"name": "http", "containerPort": port, "protocol": "TCP"}],
        env=objects.env_entries({"PYTHONUNBUFFERED": "1"}) + _proxy_secrets(planned),
        resources=objects.resources(pods, settings, pods.gpus or 0),
        volumeMounts=[{"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True}],
        readinessProbe=objects.http_probe(
            PROXY_READINESS, 5, 3, timeout_s=readiness_timeout_s(planned.topology.proxy)
        ),
        livenessProbe=objects.http_probe("/metrics", 10, 3) | {"initialDelaySeconds": 10},
    )
    volume = {"name": "topology", "configMap": {"name": config_map["metadata"]["name"]}}
    spec = objects.pod_spec(settings, pods, [proxy], volumes=[volume])
    pod_template = objects.template(pod_labels, annotations, spec)
    return [
        objects.service(name, settings, pod_labels, {"http": port}, pods.service_type),
        objects.deployment(name, settings, pod_template, replicas=pods.replicas, recreate=False),
    ]


def _proxy_secrets(planned: K8sPlan) -> list[Manifest]:
    """The connector's secret and, when named, the admin token, from the Secret."""
    entries = secret_entries(planned)
    admin_env = planned.topology.proxy.admin_token_env
    if admin_env is not None:
        settings = planned.settings
        entries.append(
            objects.secret_entry(admin_env, settings.secret_name, settings.admin_token_key)
        )
    return entries


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's topology) as ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_all(documents: list[Manifest]) -> str:
    """``documents`` as multi-document YAML, keys in the order rendered."""
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, width=100)


def main(
    config_path: str,
    *,
    output: str | None = None,
    namespace: str | None = None,
    image: str | None = None,
    secret_from_env: str | None = None,
) -> int:
    """``fabric k8s TOPOLOGY``: print (or write to ``output``) the manifests.

    With ``secret_from_env`` the Secret holds that variable's value and, when
    ``proxy.admin_token_env`` names one, that variable's admin token; a file
    holding them is written mode 0600 (a new file, renamed over the old)."""
    topology = load_topology(config_path)
    secret = token = None
    if secret_from_env is not None:
        secret = os.environ.get(secret_from_env)
        if not secret:
            raise ConfigError(
                f"--secret-from-env: environment variable {secret_from_env!r} is unset"
            )
        if topology.proxy.admin_token_env is not None:
            token = admin_token(topology)  # NOTE: checked as the proxy checks it
    options = K8sOptions(namespace=namespace, image=image, secret=secret, admin_token=token)
    text = render_yaml(topology, options)
    if output is None:
        sys.stdout.write(text)
    elif secret is not None:
        write_private(Path(output), text)
    else:
        Path(output).write_text(text)
    return 0
