"""A topology as a cluster runs it: :func:`plan` adapts it for ``fabric k8s``.

What changes from ``fabric up`` on one host:

- every port is fixed: each engine is a pod of its own (its own IP), so an
  engine without ``port`` / ``kv_port`` gets 8100 / 8101 (the same in
  every pod), and a proxy without ``port`` 8000;
- the secret is mandatory: engines bind every interface, so without
  ``connector.insecure`` the connector signs with ``secret_env``
  (``FABRIC_SECRET`` when the topology names none), read from a Secret;
- paths live in the pod: ``workdir`` is ``k8s.workdir`` (an emptyDir),
  and a relative ``disk_path`` (connector or store) is taken under it;
- with ``store:``, every engine with a reuse tier attaches to the store
  sidecar of its own pod by its endpoint file (a store per pod, not per node);
- placement is the scheduler's: ``hosts:`` and the engines' ``host:`` are
  dropped (each engine is a pod; ``k8s.engines.NAME.node_selector`` pins it);
- every launched engine gets an object name ``<k8s.name>-<engine name>``
  (a DNS label: lower case, ``_`` and ``.`` as ``-``).

Refused, with a ConfigError naming the YAML field: ``k8s.engines`` keys
that name no engine, an engine spanning pods that is not vLLM or has a
shared store, object names that are not DNS labels or collide.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError

from fabric.config import EngineConfig, K8sConfig, TopologyConfig
from fabric.errors import ConfigError
from fabric.launch.up import store_endpoint_file, with_shared_store
from fabric.settings import Settings, validating_whole

DEFAULT_PORT = 8100
DEFAULT_KV_PORT = 8101
DEFAULT_PROXY_PORT = 8000
DEFAULT_SECRET_ENV = "FABRIC_SECRET"
WILDCARD = "0.0.0.0"
RESERVED_SUFFIXES = ("proxy", "topology")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class K8sOptions(Settings):
    """``fabric k8s``'s flags: ``namespace`` and ``image`` override the
    ``k8s:`` section's; ``secret``: the connector's secret value, rendered as
    a Secret (None: the Secret ``k8s.secret_name`` must exist);
    ``admin_token``: the proxy's, rendered in that Secret too (needed with
    ``secret`` when ``proxy.admin_token_env`` is set)."""

    namespace: str | None = None
    image: str | None = None
    secret: str | None = Field(default=None, repr=False)
    admin_token: str | None = Field(default=None, repr=False)


@dataclass(frozen=True)
class K8sPlan:
    """The adapted ``topology``, the ``settings`` in effect and each launched
    engine's object name (``names``: engine name -> object name)."""

    topology: TopologyConfig
    settings: K8sConfig
    names: dict[str, str]
    options: K8sOptions

    @property
    def proxy_port(self) -> int:
        """The proxy's port (fixed by :func:`plan`)."""
        port = self.topology.proxy.port
        assert port is not None, "plan fixes the proxy's port"
        return port

    def object_name(self, suffix: str) -> str:
        """``<k8s.name>-<suffix>``."""
        return f"{self.settings.name}-{suffix}"


def plan(topology: TopologyConfig, options: K8sOptions | None = None) -> K8sPlan:
    """``topology`` adapted for a cluster (see the module); ConfigError on what
    a cluster cannot run."""
    options = options or K8sOptions()
    settings = _settings(topology, options)
    _check(topology, settings)
    adapted = _adapted(topology, settings)
    return K8sPlan(adapted, settings, _names(adapted, settings), options)


def launched_engines(topology: TopologyConfig) -> list[tuple[str, EngineConfig]]:
    """``(path, engine)`` of every engine the cluster runs (not given by ``url``)."""
    return [(path, e) for path, e in topology.engines_with_paths() if e.launched]


def _settings(topology: TopologyConfig, options: K8sOptions) -> K8sConfig:
    base = topology.k8s or K8sConfig()
    flags = {"namespace": options.namespace, "image": options.image}
    update = {key: value for key, value in flags.items() if value is not None}
    if not update:
        return base
    try:
        with validating_whole():
            return K8sConfig.model_validate(base.model_dump(exclude_unset=True) | update)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        flag = f"--{first['loc'][0]}"
        raise ConfigError(f"{flag}: {first['msg']}") from exc


def _check(topology: TopologyConfig, settings: K8sConfig) -> None:
    launched = {engine.name: path for path, engine in launched_engines(topology)}
    for name in settings.engines:
        if name not in launched:
            raise ConfigError(f"k8s.engines.{name}: no engine of that name is launched")
    for name, path in launched.items():
        engine = next(e for e in topology.engines if e.name == name)
        if settings.engine_pods(name).pods_per_engine > 1:
            _check_spanning(topology, engine, path)


def _check_spanning(topology: TopologyConfig, engine: EngineConfig, path: str) -> None:
    field = f"k8s.engines.{engine.name}.pods_per_engine"
    if engine.command is not None:
        raise ConfigError(f"{field}: {path} has a command; only vLLM engines span pods")
    if topology.store is not None:
        raise ConfigError(
            f"{field}: the shared store (store:) is per pod and needs TP size 1; an "
            "engine spanning pods cannot attach to it"
        )


def _adapted(topology: TopologyConfig, settings: K8sConfig) -> TopologyConfig:
    connector = topology.connector
    secret_env = connector.secret_env
    if secret_env is None and not connector.insecure:
        secret_env = DEFAULT_SECRET_ENV
    update: dict[str, Any] = {
        "workdir": settings.workdir,
        "connector": connector.model_copy(
            update={
                "secret_env": secret_env,
                "disk_path": _in_pod(connector.disk_path, settings.workdir),
            }
        ),
        "proxy": topology.proxy.model_copy(
            update={"port": topology.proxy.port or DEFAULT_PROXY_PORT}
        ),
        "prefill": [_fixed_ports(e) for e in topology.prefill],
        "decode": [_fixed_ports(e) for e in topology.decode],
        **_unplaced(topology),
    }
    if topology.store is None:
        return topology.model_copy(update=update)
    disk = _in_pod(topology.store.disk_path, settings.workdir)
    update["store"] = topology.store.model_copy(update={"disk_path": disk})
    adapted = topology.model_copy(update=update)
    # NOTE: the file, as fabric up: a store sidecar restarted on a new port is found again.
    return with_shared_store(adapted, str(store_endpoint_file(adapted)))


def _fixed_ports(engine: EngineConfig) -> EngineConfig:
    if not engine.launched:
        return engine
    port = engine.port or DEFAULT_PORT
    kv_port = engine.kv_port or DEFAULT_KV_PORT
    return engine.model_copy(update={"port": port, "kv_port": kv_port, **_unplaced(engine)})


def _unplaced(model: EngineConfig | TopologyConfig) -> dict[str, Any]:
    """The update that drops a host placement (``hosts:``, an engine's ``host:``)
    from ``model``: only fields its model has."""
    empty: dict[str, Any] = {"hosts": {}, "host": None, "host_address": None}
    return {key: value for key, value in empty.items() if key in type(model).model_fields}


def _in_pod(path: str | None, workdir: str) -> str | None:
    """``path`` inside the pod: as is when absolute, else under ``workdir``."""
    if path is None or posixpath.isabs(path):
        return path
    return posixpath.normpath(posixpath.join(workdir, path))


def _names(topology: TopologyConfig, settings: K8sConfig) -> dict[str, str]:
    reserved = {f"{settings.name}-{suffix}": suffix for suffix in RESERVED_SUFFIXES}
    names: dict[str, str] = {}
    seen: dict[str, str] = {}
    for path, engine in launched_engines(topology):
        name = f"{settings.name}-{engine.name.lower().replace('_', '-').replace('.', '-')}"
        if len(name) > 63 or not _DNS_LABEL.match(name):
            raise ConfigError(
                f"{path}.name: {engine.name!r} makes the object name {name!r}, not a DNS "
                "label (at most 63 of a-z, 0-9 and '-', ending in a letter or digit)"
            )
        if name in reserved:
            raise ConfigError(f"{path}.name: {name!r} is the {reserved[name]}'s object name")
        if name in seen:
            raise ConfigError(f"{path}.name: object name {name!r} is also {seen[name]}'s")
        seen[name], names[engine.name] = path, name
    return names
