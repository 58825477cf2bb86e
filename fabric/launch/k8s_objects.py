"""Kubernetes objects as plain dicts: the pieces :mod:`fabric.launch.k8s` assembles.

Nothing here knows a topology: metadata and labels, env entries, probes,
resources, a pod spec, a Deployment and a Service, and the deep merge that
applies ``k8s.overrides`` to what was rendered. Every builder returns a new
dict; :func:`deep_merge` never changes its inputs.
"""

from __future__ import annotations

import copy
from typing import Any

from fabric.config import K8sConfig, K8sPodConfig
from fabric.errors import ConfigError

Manifest = dict[str, Any]

PART_OF = "app.kubernetes.io/part-of"
NAME = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
WORK_VOLUME = "work"
SHM_VOLUME = "dshm"


def labels(settings: K8sConfig, name: str, component: str) -> dict[str, str]:
    """The labels of object ``name`` (and of its pods)."""
    return {PART_OF: settings.name, NAME: name, COMPONENT: component, MANAGED_BY: "fabric"}


def selector(pod_labels: dict[str, str]) -> dict[str, str]:
    """The labels a Service or workload selects its pods by."""
    return {key: pod_labels[key] for key in (PART_OF, NAME)}


def metadata(
    name: str, settings: K8sConfig, object_labels: dict[str, str] | None = None
) -> Manifest:
    """``metadata`` of a rendered object: its name, namespace (when set) and labels."""
    out: Manifest = {"name": name}
    if settings.namespace is not None:
        out["namespace"] = settings.namespace
    if object_labels:
        out["labels"] = dict(object_labels)
    return out


def prometheus_annotations(settings: K8sConfig, port: int) -> dict[str, str]:
    """Pod annotations Prometheus' Kubernetes discovery scrapes by (none when off)."""
    if not settings.prometheus:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def env_entries(values: dict[str, str]) -> list[Manifest]:
    """``[{name, value}]`` for a container's ``env``."""
    return [{"name": name, "value": value} for name, value in values.items()]


def secret_entry(variable: str, secret_name: str, key: str) -> Manifest:
    """An env entry whose value is key ``key`` of Secret ``secret_name``."""
    return {"name": variable, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key}}}


def field_entry(variable: str, field_path: str) -> Manifest:
    """An env entry from the downward API (e.g. ``status.podIP``)."""
    return {"name": variable, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def http_probe(path: str, period_s: int, failures: int, *, timeout_s: int = 5) -> Manifest:
    """A probe that GETs ``path`` on the container's ``http`` port."""
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failures,
    }


def resources(pod: K8sPodConfig, settings: K8sConfig, gpus: int) -> Manifest:
    """A container's ``resources``: cpu and memory requests, memory, GPU and
    RDMA limits (extended resources are requested by their limit)."""
    requests = {key: value for key in ("cpu", "memory") if (value := getattr(pod, key))}
    limits: dict[str, Any] = {"memory": pod.memory} if pod.memory else {}
    if gpus:
        limits[settings.gpu_resource] = gpus
    if pod.rdma:
        limits[settings.rdma_resource] = pod.rdma
    out: Manifest = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def container(name: str, command: list[str], settings: K8sConfig, **fields: Any) -> Manifest:
    """A container of ``settings.image`` running ``command``; ``fields`` are
    added as given (empty ones left out)."""
    out: Manifest = {
        "name": name,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": command,
    }
    out.update({key: value for key, value in fields.items() if value})
    return out


def pod_spec(
    settings: K8sConfig, pod: K8sPodConfig, containers: list[Manifest], **fields: Any
) -> Manifest:
    """A pod spec: ``containers``, the service account, node selector and
    tolerations of ``pod``; ``fields`` added as given (empty ones left out)."""
    out: Manifest = {"containers": containers}
    if settings.service_account is not None:
        out["serviceAccountName"] = settings.service_account
    if pod.node_selector:
        out["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        out["tolerations"] = copy.deepcopy(pod.tolerations)
    out.update({key: value for key, value in fields.items() if value})
    return out


def work_volumes(with_shm: bool) -> list[Manifest]:
    """An emptyDir for the workdir, and one in memory for ``/dev/shm``
    (vLLM's workers share tensors through it; a container's default is 64 MiB)."""
    volumes: list[Manifest] = [{"name": WORK_VOLUME, "emptyDir": {}}]
    if with_shm:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    return volumes


def template(pod_labels: dict[str, str], annotations: dict[str, str], spec: Manifest) -> Manifest:
    """A pod template."""
    meta: Manifest = {"labels": dict(pod_labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"metadata": meta, "spec": spec}


def deployment(
    name: str, settings: K8sConfig, pod_template: Manifest, *, replicas: int, recreate: bool
) -> Manifest:
    """A Deployment of ``replicas`` pods (``recreate``: the old pod goes before
    the new one starts, so a pod holding GPUs needs no spare ones)."""
    pod_labels = pod_template["metadata"]["labels"]
    spec: Manifest = {
        "replicas": replicas,
        "selector": {"matchLabels": selector(pod_labels)},
        "template": pod_template,
    }
    if recreate:
        spec["strategy"] = {"type": "Recreate"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, settings, pod_labels),
        "spec": spec,
    }


def service(
    name: str,
    settings: K8sConfig,
    pod_labels: dict[str, str],
    ports: dict[str, int],
    service_type: str = "ClusterIP",
) -> Manifest:
    """A Service of ``service_type`` selecting the pods labelled ``pod_labels``;
    ``ports`` maps each port's name to its number (the container's the same)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, settings, pod_labels),
        "spec": {
            "type": service_type,
            "selector": selector(pod_labels),
            "ports": [
                {"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}
                for port_name, port in ports.items()
            ],
        },
    }


def apply_overrides(
    documents: list[Manifest], overrides: dict[str, dict[str, Any]]
) -> list[Manifest]:
    """``documents`` with each ``k8s.overrides`` entry (``Kind/name``) deep-merged
    into the object it names; a key that names none is a ConfigError."""
    by_key = {f"{doc['kind']}/{doc['metadata']['name']}": i for i, doc in enumerate(documents)}
    out = list(documents)
    for key, patch in overrides.items():
        if key not in by_key:
            rendered = ", ".join(by_key)
            raise ConfigError(
                f"k8s.overrides.{key}: no such rendered object (rendered: {rendered})"
            )
        out[by_key[key]] = deep_merge(out[by_key[key]], patch)
    return out


def deep_merge(base: Any, patch: Any) -> Any:
    """``patch`` merged into ``base``: mappings key by key (a ``None`` value
    deletes the key), lists of named mappings by ``name``, anything else replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = deep_merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    if patch and _named_items(base) and _named_items(patch):
        return _merge_named(base, patch)
    return copy.deepcopy(patch)


def _named_items(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) and "name" in v for v in value)


def _merge_named(base: list[Manifest], patch: list[Manifest]) -> list[Manifest]:
    """Items of ``patch`` merged into the item of ``base`` with the same name, or appended."""
    out = copy.deepcopy(base)
    index = {item["name"]: i for i, item in enumerate(out)}
    for item in patch:
        if item["name"] in index:
            out[index[item["name"]]] = deep_merge(out[index[item["name"]]], item)
        else:
            out.append(copy.deepcopy(item))
    return out
