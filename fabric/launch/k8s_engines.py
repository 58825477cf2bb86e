"""An engine of a planned topology as Kubernetes objects: a Service and a
Deployment, or a LeaderWorkerSet when it spans pods.

The container runs the command ``fabric up`` would run
(:func:`fabric.launch.up.engine_command`), changed only where a pod differs
from a host's process: vLLM binds ``0.0.0.0`` (a ``command`` template gets
``{host}`` ``0.0.0.0`` and ``{address}`` ``$(VLLM_HOST_IP)``, which
Kubernetes expands), the connector's ``host`` is
``0.0.0.0`` and it advertises ``$VLLM_HOST_IP`` (the pod's IP, from the
downward API; see :mod:`fabric.transfer.addresses`), the interpreter is
``k8s.python``, and a tiny model is the one an initContainer built into the
pod's workdir (served under its name). The environment is not
``fabric up``'s: no loopback UCX devices, no CPU pinning and no
``CUDA_VISIBLE_DEVICES`` (the device plugin hands the pod its GPUs; their
count is taken from ``cuda_visible_devices`` unless ``gpus`` says).

One pod per engine::

    initContainers: model (tiny models: fabric model tiny DIR)
                    store (with store:, a sidecar: fabric store serve on loopback,
                           started before the engine, restarted on its own)
    containers:     engine (vLLM with the FabricConnector; ports http, kv, kv-1..)
    volumes:        work (emptyDir at k8s.workdir), dshm (memory, /dev/shm)

Spanning pods (``pods_per_engine`` N > 1) uses vLLM's multi-node mode
without Ray: ``--nnodes``, ``--node-rank`` and ``--master-addr``
(``vllm/engine/arg_utils.py``: ``add_cli_args`` declares them,
``create_engine_config`` checks that N divides the world size and needs the
``mp`` backend) and ``--headless`` (``vllm/entrypoints/cli/serve.py``:
``run_headless`` runs a node rank > 0 as workers that join the leader's
torch.distributed group at ``master_addr``). The leader (node rank 0)
serves; workers ``1..N-1`` run headless, joining ``$(LWS_LEADER_ADDRESS)``
as node rank ``$(LWS_WORKER_INDEX)``, both set by the LeaderWorkerSet
controller. The connector's rank r listens on ``kv_port + r`` in the pod
that runs it, and the engine's Service reaches the leader's pod only.
"""

from __future__ import annotations

import json
import math
import posixpath
import sys
from typing import Any

from fabric.config import EngineConfig
from fabric.errors import ConfigError
from fabric.launch.drain import DRAIN_FILE_ENV, DRAIN_TIMEOUT_ENV
from fabric.launch.k8s_objects import (
    SHM_VOLUME,
    WORK_VOLUME,
    Manifest,
    container,
    deployment,
    env_entries,
    field_entry,
    http_probe,
    labels,
    metadata,
    pod_spec,
    prometheus_annotations,
    resources,
    secret_entry,
    service,
    template,
    work_volumes,
)
from fabric.launch.k8s_plan import WILDCARD, K8sPlan
from fabric.launch.up import (
    TINY_MODELS,
    drain_file,
    engine_command,
    kv_transfer_config,
    stop_timeout,
    store_command,
    store_endpoint_file,
)
from fabric.transfer.addresses import HOST_IP_ENV

LWS_API = "leaderworkerset.x-k8s.io/v1"
# NOTE: a pod's environment starts empty: only what fabric up adds on top of
# os.environ that holds in a pod too (no loopback UCX, pinning or dirs).
POD_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TORCH_COMPILE_DISABLE": "1",
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
PROBE_PERIOD_S = 10
# NOTE: a command template's {host} and {address} in a pod: Kubernetes
# expands $(VLLM_HOST_IP) in the container's command from its env (the pod's IP).
POD_TEMPLATE = {"host": WILDCARD, "address": f"$({HOST_IP_ENV})"}


def engine_documents(plan: K8sPlan, engine: EngineConfig) -> list[Manifest]:
    """The Service and the workload of launched ``engine``."""
    name = plan.names[engine.name]
    pod_labels = labels(plan.settings, name, engine.role)
    ports = {"http": _port(engine), **kv_ports(engine)}
    pods = plan.settings.engine_pods(engine.name).pods_per_engine
    workload = _spanning(plan, engine, pods) if pods > 1 else _single(plan, engine)
    return [service(name, plan.settings, pod_labels, ports), workload]


def kv_ports(engine: EngineConfig) -> dict[str, int]:
    """The connector's ports: ``kv_port`` + r for each tensor-parallel rank r."""
    kv_port = engine.kv_port
    assert kv_port is not None, "plan fixes every kv_port"
    out = {"kv" if r == 0 else f"kv-{r}": kv_port + r for r in range(_tp_size(engine))}
    if _port(engine) in out.values():
        raise ConfigError(
            f"{engine.name}.kv_port: {kv_port}..{kv_port + len(out) - 1} (one per TP rank) "
            f"takes its port {engine.port}"
        )
    return out


def container_command(plan: K8sPlan, engine: EngineConfig) -> list[str]:
    """``fabric up``'s command for ``engine``, as its pod runs it (see the module)."""
    pod_engine = _pod_engine(plan, engine)
    argv = engine_command(pod_engine, plan.topology, template=POD_TEMPLATE)
    if pod_engine.command is None:
        argv[argv.index("--host") + 1] = WILDCARD
        old = argv[argv.index("--kv-transfer-config") + 1]
    else:
        config = kv_transfer_config(pod_engine, plan.topology.connector)
        old = json.dumps(config, separators=(",", ":"))
    new = json.dumps(_bound_to_pod(json.loads(old)), separators=(",", ":"))
    python = plan.settings.python
    return [arg.replace(old, new).replace(sys.executable, python) for arg in argv]


def _bound_to_pod(config: dict[str, Any]) -> dict[str, Any]:
    """A kv-transfer-config whose connector binds every interface and advertises
    the pod's IP (``$VLLM_HOST_IP``: no ``advertise_host``)."""
    extra = dict(config["kv_connector_extra_config"])
    extra.pop("advertise_host", None)
    extra["host"] = WILDCARD
    return {**config, "kv_connector_extra_config": extra}


def _pod_engine(plan: K8sPlan, engine: EngineConfig) -> EngineConfig:
    """``engine`` with a tiny model named by its path in the pod (served by name)."""
    if engine.model not in TINY_MODELS:
        return engine
    args = list(engine.args)
    if engine.command is None and "--served-model-name" not in args:
        args += ["--served-model-name", engine.model]
    return engine.model_copy(update={"model": _tiny_dir(plan, engine.model), "args": args})


def _tiny_dir(plan: K8sPlan, model: str) -> str:
    """Where the initContainer builds a tiny model: ``WORKDIR/models/NAME``, as ``fabric up``."""
    return posixpath.join(plan.settings.workdir, "models", model)


def _single(plan: K8sPlan, engine: EngineConfig) -> Manifest:
    name = plan.names[engine.name]
    pod_labels = labels(plan.settings, name, engine.role)
    spec = _pod(plan, engine, container_command(plan, engine), serving=True)
    pod_template = template(pod_labels, _annotations(plan, engine), spec)
    return deployment(name, plan.settings, pod_template, replicas=1, recreate=True)


def _spanning(plan: K8sPlan, engine: EngineConfig, pods: int) -> Manifest:
    """A LeaderWorkerSet of one group of ``pods`` pods running ``engine``."""
    name = plan.names[engine.name]
    argv = container_command(plan, engine)
    joined = ["--nnodes", str(pods), "--master-addr", "$(LWS_LEADER_ADDRESS)"]
    leader = _pod(plan, engine, [*argv, *joined, "--node-rank", "0"], serving=True)
    worker_argv = [*argv, *joined, "--node-rank", "$(LWS_WORKER_INDEX)", "--headless"]
    worker = _pod(plan, engine, worker_argv, serving=False)
    leader_labels = labels(plan.settings, name, engine.role)
    # NOTE: workers carry another name label, so the engine's Service selects the leader only.
    worker_labels = labels(plan.settings, f"{name}-worker", engine.role)
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": metadata(name, plan.settings, leader_labels),
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": pods,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template(leader_labels, _annotations(plan, engine), leader),
                "workerTemplate": template(worker_labels, {}, worker),
            },
        },
    }


def _annotations(plan: K8sPlan, engine: EngineConfig) -> dict[str, str]:
    return prometheus_annotations(plan.settings, _port(engine))


def _pod(plan: K8sPlan, engine: EngineConfig, argv: list[str], *, serving: bool) -> Manifest:
    """The pod spec of ``engine`` running ``argv``; ``serving``: it answers HTTP
    (probes and ports; an LWS worker does not)."""
    settings = plan.settings
    pods = settings.engine_pods(engine.name)
    gpus = pods.gpus if pods.gpus is not None else _visible_gpus(engine)
    fields: dict[str, Any] = {
        "env": _env(plan, engine),
        "resources": resources(pods, settings, gpus),
        "volumeMounts": _mounts(plan),
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}} if pods.rdma else None,
    }
    if serving:
        fields |= _probes(plan) | {"ports": _container_ports(engine)}
    grace = math.ceil(stop_timeout(plan.topology.proxy.drain_timeout_s))
    engine_container = container("engine", argv, settings, **fields)
    return pod_spec(
        settings,
        pods,
        [engine_container],
        initContainers=_init_containers(plan, engine, serving=serving),
        volumes=work_volumes(with_shm=True),
        terminationGracePeriodSeconds=grace,
    )


def _probes(plan: K8sPlan) -> dict[str, Manifest]:
    """Startup bounded by ``startup_timeout_s``; readiness on ``/health``;
    liveness on ``/health`` too, but failing only after a whole drain and
    vLLM's shutdown (a draining engine answers 503 there and must not be killed)."""
    topology = plan.topology
    startup = math.ceil(topology.startup_timeout_s / PROBE_PERIOD_S)
    live = math.ceil(stop_timeout(topology.proxy.drain_timeout_s) / PROBE_PERIOD_S) + 1
    return {
        "startupProbe": http_probe("/health", PROBE_PERIOD_S, max(startup, 1)),
        "readinessProbe": http_probe("/health", 5, 2),
        "livenessProbe": http_probe("/health", PROBE_PERIOD_S, max(live, 3)),
    }


def _container_ports(engine: EngineConfig) -> list[Manifest]:
    ports = {"http": _port(engine), **kv_ports(engine)}
    return [
        {"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports.items()
    ]


def _mounts(plan: K8sPlan) -> list[Manifest]:
    return [
        {"name": WORK_VOLUME, "mountPath": plan.settings.workdir},
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
    ]


def _env(plan: K8sPlan, engine: EngineConfig) -> list[Manifest]:
    """Fabric's engine settings, the drain file and timeout, the engine's
    ``env``, the pod's IP as ``VLLM_HOST_IP`` and the secret."""
    values = {**POD_ENV, "VLLM_CPU_KVCACHE_SPACE": str(engine.kv_cache_gib)}
    if engine.model in TINY_MODELS:
        values |= OFFLINE_ENV
    values[DRAIN_FILE_ENV] = str(drain_file(engine, plan.topology))
    values[DRAIN_TIMEOUT_ENV] = str(plan.topology.proxy.drain_timeout_s)
    values |= engine.env
    entries = env_entries(values)
    if HOST_IP_ENV not in engine.env:
        entries.append(field_entry(HOST_IP_ENV, "status.podIP"))
    return entries + secret_entries(plan)


def secret_entries(plan: K8sPlan) -> list[Manifest]:
    """The connector's secret from the Secret, when the topology signs."""
    variable = plan.topology.connector.secret_env
    if variable is None:
        return []
    settings = plan.settings
    return [secret_entry(variable, settings.secret_name, settings.secret_key)]


def _init_containers(plan: K8sPlan, engine: EngineConfig, *, serving: bool) -> list[Manifest]:
    """The tiny model's builder (every pod loads the weights) and, where the
    engine serves, the store sidecar."""
    out = []
    if engine.model in TINY_MODELS:
        out.append(_tiny_model(plan, engine.model))
    if serving and plan.topology.store is not None and _keeps_reuse_tier(plan, engine):
        out.append(_store_sidecar(plan))
    return out


def _tiny_model(plan: K8sPlan, model: str) -> Manifest:
    """An initContainer that builds tiny ``model`` into the pod's workdir."""
    python = plan.settings.python
    argv = [python, "-m", "fabric.cli", "model", "tiny", _tiny_dir(plan, model)]
    if TINY_MODELS[model]:
        argv.append("--kv-heavy")
    return container("model", argv, plan.settings, volumeMounts=_mounts(plan)[:1])


def _keeps_reuse_tier(plan: K8sPlan, engine: EngineConfig) -> bool:
    config = kv_transfer_config(engine, plan.topology.connector)
    return bool(config["kv_connector_extra_config"]["reuse"])


def _store_sidecar(plan: K8sPlan) -> Manifest:
    """The shared store as a native sidecar (an initContainer that keeps running):
    on the pod's loopback, ready once its endpoint file is written."""
    store = plan.topology.store
    assert store is not None
    python = plan.settings.python
    argv = [arg.replace(sys.executable, python) for arg in store_command(store, plan.topology)]
    endpoint = str(store_endpoint_file(plan.topology))
    memory = f"{math.ceil(store.mem_gib * 1024)}Mi"
    return container(
        "store",
        argv,
        plan.settings,
        restartPolicy="Always",
        env=env_entries({"PYTHONUNBUFFERED": "1"}) + secret_entries(plan),
        resources={"requests": {"memory": memory}},
        volumeMounts=_mounts(plan)[:1],
        startupProbe={
            "exec": {"command": ["test", "-s", endpoint]},
            "periodSeconds": 1,
            "failureThreshold": max(math.ceil(store.startup_timeout_s), 1),
        },
    )


def _visible_gpus(engine: EngineConfig) -> int:
    devices = engine.cuda_visible_devices
    if not devices:
        return 0
    return len([d for d in devices.split(",") if d.strip()])


def _port(engine: EngineConfig) -> int:
    assert engine.port is not None, "plan fixes every port"
    return engine.port


def _tp_size(engine: EngineConfig) -> int:
    """The tensor-parallel size in ``engine.args`` (1 when not given)."""
    value = "1"
    for i, arg in enumerate(engine.args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and i + 1 < len(engine.args):
                value = engine.args[i + 1]
            elif arg.startswith(f"{flag}="):
                value = arg.split("=", 1)[1]
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{engine.name}.args: tensor-parallel size {value!r} is not a count")
    return int(value)
