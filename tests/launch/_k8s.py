"""Checks of rendered Kubernetes manifests for tests/launch/test_k8s.py.

Core kinds are validated with ``kubernetes-validate`` (the Kubernetes
OpenAPI schemas of ``K8S_VERSION``, strict: unknown fields are errors).
The LeaderWorkerSet is a CRD, not in those schemas: its envelope is checked
against :data:`LWS_SCHEMA`, written from the fields of the upstream CRD
(kubernetes-sigs/lws, ``leaderworkerset.x-k8s.io/v1``) that fabric renders,
and each of its pod templates against the core PodTemplate schema.

``kubectl apply --dry-run=client`` still asks a server for discovery and
for the objects it would change: :func:`stub_api_server` answers the
discovery of the kinds fabric renders and 404 for every object.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

K8S_VERSION = "1.32.0"

_INT32 = {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}
_TEMPLATE = {
    "type": "object",
    "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}},
    "required": ["spec"],
    "additionalProperties": False,
}
LWS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
            },
        },
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": _INT32,
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": _INT32,
                        "restartPolicy": {
                            "enum": [
                                "Default",
                                "RecreateGroupOnPodRestart",
                                "RecreateGroupAfterStart",
                                "None",
                            ]
                        },
                        "leaderTemplate": _TEMPLATE,
                        "workerTemplate": _TEMPLATE,
                    },
                },
            },
        },
    },
}


def validate(document: dict[str, Any]) -> None:
    """Raise (a ``jsonschema.ValidationError``) unless ``document`` is a valid object."""
    if document.get("kind") != "LeaderWorkerSet":
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
        return
    jsonschema.validate(document, LWS_SCHEMA)
    templates = document["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": document["metadata"]["name"]},
            "template": templates[key],
        }
        kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


_RESOURCES = {
    "/api/v1": ("v1", {"configmaps": "ConfigMap", "services": "Service", "secrets": "Secret"}),
    "/apis/apps/v1": ("apps/v1", {"deployments": "Deployment"}),
    "/apis/leaderworkerset.x-k8s.io/v1": (
        "leaderworkerset.x-k8s.io/v1",
        {"leaderworkersets": "LeaderWorkerSet"},
    ),
}


class _Discovery(BaseHTTPRequestHandler):
    """Legacy discovery of the kinds fabric renders; 404 for anything else."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/api":
            self._answer(200, {"kind": "APIVersions", "versions": ["v1"]})
        elif path == "/apis":
            self._answer(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": _groups()})
        elif path in _RESOURCES:
            version, kinds = _RESOURCES[path]
            resources = [
                {
                    "name": name,
                    "singularName": "",
                    "namespaced": True,
                    "kind": kind,
                    "verbs": ["get"],
                }
                for name, kind in kinds.items()
            ]
            body = {"kind": "APIResourceList", "groupVersion": version, "resources": resources}
            self._answer(200, body)
        else:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
            self._answer(404, status | {"reason": "NotFound", "message": "not found"})

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _groups() -> list[dict[str, Any]]:
    out = []
    for group in ("apps", "leaderworkerset.x-k8s.io"):
        version = {"groupVersion": f"{group}/v1", "version": "v1"}
        out.append({"name": group, "versions": [version], "preferredVersion": version})
    return out


@contextlib.contextmanager
def stub_api_server(directory: Path) -> Iterator[Path]:
    """Serve :class:`_Discovery` on loopback while in the block; yields a
    kubeconfig in ``directory`` that points kubectl at it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discovery)
    thread = threading.Thread(target=server.serve_forever, name="stub-api", daemon=True)
    thread.start()
    config = directory / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "stub",
                        "cluster": {"server": f"http://127.0.0.1:{server.server_port}"},
                    }
                ],
                "users": [{"name": "stub", "user": {}}],
                "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
                "current-context": "stub",
            }
        )
    )
    try:
        yield config
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
