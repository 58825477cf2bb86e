"""``fabric up CONFIG``: start a topology's engines and its proxy, keep them running,
drain and stop them on a signal.

::

    load YAML -> bind the proxy socket (a taken port fails before anything starts)
              -> with a ``store:`` section: start the shared store
                 (``fabric store serve``, log WORKDIR/logs/store.log), wait for
                 its endpoint file; every engine gets that file as its
                 ``shared_store`` (so a restarted store is found again)
              -> choose free ports, build the tiny model if named
              -> start every engine (all at once), logs in WORKDIR/logs/NAME.log
              -> wait until every /health answers (bounded; on failure print
                 that engine's log tail and stop everything)
              -> serve the proxy in this process, print its URL,
                 write WORKDIR/run/up.json
    while serving -> supervise (:mod:`fabric.launch.supervisor`): an engine
                 or the store that exits is marked down in the proxy at once,
                 what is left of its process group is killed (vLLM's
                 EngineCore and workers outlive an API server killed alone),
                 and it is restarted with backoff (1 s doubling to 30 s) on
                 the same ports and args once that group is gone; up.json is
                 rewritten on every change
    SIGTERM/SIGINT/SIGHUP -> drain the proxy (:mod:`fabric.launch.proxy_server`):
                 new requests get 503 JSON, requests in flight finish (at
                 most ``--drain-timeout-s``, default 30 s), then stop the
                 proxy, then every engine (SIGTERM to its pid: each drains
                 what it still has, within the same drain timeout; its
                 process group gets SIGKILL once it exited, or after the
                 drain timeout + ``STOP_MARGIN_S`` for vLLM's own shutdown),
                 then the shared store
    SIGUSR1 -> restart the engines that were drained on purpose

``WORKDIR/run/up.json``: ``proxy_url``, ``state`` (``serving`` or
``draining``), ``drain_timeout_s``, and per engine (and ``store``): ``pid``
(the current process), ``log``, ``state`` (``starting``, ``up``, ``down``,
``draining``, ``stopped``; None for an engine fabric up did not start),
``restarts``, ``last_exit`` (``pid``, ``returncode``, ``how``: ``exit code
3`` / ``signal SIGKILL``, ``at``: wall clock),
``last_restart_to_serving_s`` (from the exit to healthy again),
``last_restart_boot_s`` (from the restart's spawn to healthy again: the
part of the above the program's own start took) and ``first_start_s``
(from its first spawn to its first healthy answer).

Signals are handled from start to exit. SIGHUP stops like SIGTERM: a
closed terminal or SSH session drains and stops everything rather than
ending ``fabric up`` alone, with the engines (each in a session of its
own) left running. While the engines start, a stop signal stops those
started so far and SIGUSR1 is ignored (nothing is stopped yet); while
``fabric up`` stops, every one of them is ignored. If the proxy does not
start (uvicorn or the app's lifespan startup fails), ``fabric up`` stops
everything and exits 1.

One engine: SIGTERM to its pid (not its process group: vLLM's executor
workers exit on a SIGTERM of their own and fail what is in flight) drains it -- the
proxy stops routing to it at once, its requests in flight finish (bounded
by the same drain timeout), then it exits and is not restarted (see
:mod:`fabric.launch.drain`; vLLM engines get the hook from
:mod:`fabric.launch.vllm_main`, a ``command`` engine can opt in by writing
the file named by ``$FABRIC_DRAIN_FILE`` when it starts draining).

Under systemd, run ``fabric up`` with ``KillMode=mixed``: ``systemctl
stop`` then sends SIGTERM to ``fabric up`` alone, which drains and stops
the engines in order, and SIGKILL to what is left in the unit only after
``TimeoutStopSec``. The default, ``KillMode=control-group``, sends SIGTERM
to every process of the unit at once, vLLM's workers included, which fails
the requests in flight. Give ``TimeoutStopSec`` at least twice the drain
timeout plus 2 minutes: the proxy's drain, then the engines' (each bounded
by the drain timeout + ``STOP_MARGIN_S``), then the store's stop (bounded
by ``STOP_MARGIN_S``).

The proxy runs in this process rather than as a child: its lifetime is the
launcher's, one signal handler stops everything in order, and there is no
extra interpreter to start, health-wait or leak.

Models: ``tiny`` and ``tiny-kv-heavy`` name the local random-weight Llamas at
``WORKDIR/models/NAME``, built by ``fabric.testing.models.tiny.make_tiny_model`` when
missing and served under that name. Anything else goes to vLLM as is.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from pydantic import Field, model_validator

from fabric.config import (
    EngineConfig,
    SharedStoreConfig,
    TopologyConfig,
    TopologyConnectorConfig,
    load_topology,
)
from fabric.errors import ConfigError, LaunchError, ProcessExited, StartTimeout
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.launch.drain import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DRAIN_FILE_ENV,
    DRAIN_TIMEOUT_ENV,
)
from fabric.launch.hosts import Placement, engine_bind, host_entry, host_environment, place
from fabric.launch.process import (
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
)
from fabric.launch.proxy_server import STOP_SIGNALS
from fabric.launch.running import (
    PROBE_TIMEOUT_S,
    Announce,
    EngineRun,
    Running,
    serve_engines,
    serve_proxy,
)
from fabric.launch.secret import with_secret
from fabric.launch.supervisor import Child, RestartPolicy
from fabric.settings import Settings

logger = logging.getLogger(__name__)

TINY_MODELS = {"tiny": False, "tiny-kv-heavy": True}  # name -> kv_heavy
STOP_MARGIN_S = 30.0  # an engine's stop bound past its drain: vLLM's own shutdown


def say(message: str) -> None:
    """Print one progress line at once (stdout may be a pipe)."""
    print(message, flush=True)


class UpOptions(Settings):
    """``fabric up``'s own settings (its command-line flags).

    ``drain_timeout_s``: how long a SIGTERM waits for requests in flight, in
    the proxy and in each engine (None: ``proxy.drain_timeout_s`` of the
    topology where it has one, else 30 s). ``restart``: the restart backoff.
    ``host``: the ``hosts:`` name of this machine in a topology across hosts
    (``--host``): only its engines, its shared store and, if it runs there,
    the proxy are started.
    """

    drain_timeout_s: float | None = None
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    host: str | None = None

    @model_validator(mode="after")
    def _check(self) -> UpOptions:
        if self.drain_timeout_s is not None and not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout-s: must be >= 0, got {self.drain_timeout_s}")
        return self

    def drain_timeout(self, topology: TopologyConfig) -> float:
        """The drain timeout in effect for ``topology``."""
        if self.drain_timeout_s is not None:
            return self.drain_timeout_s
        return topology.proxy.drain_timeout_s


def resolve_ports(topology: TopologyConfig) -> TopologyConfig:
    """A copy where every launched engine has a ``port`` and a ``kv_port``."""
    taken = {p for e in topology.engines for p in (e.port, e.kv_port) if p is not None}
    if topology.proxy.port is not None:
        taken.add(topology.proxy.port)

    def pick() -> int:
        port = free_port()
        while port in taken:
            port = free_port()
        taken.add(port)
        return port

    def resolve(engine: EngineConfig) -> EngineConfig:
        if not engine.launched:
            return engine
        return engine.model_copy(
            update={"port": engine.port or pick(), "kv_port": engine.kv_port or pick()}
        )

    return topology.model_copy(
        update={
            "prefill": [resolve(e) for e in topology.prefill],
            "decode": [resolve(e) for e in topology.decode],
        }
    )


def model_location(model: str, workdir: Path) -> tuple[str, str | None]:
    """``(what vLLM loads, served model name)``; builds a tiny model if missing."""
    if model not in TINY_MODELS:
        return model, None
    from fabric.testing.models.tiny import make_tiny_model

    logger.info("model %s: %s (built if missing)", model, workdir / "models" / model)
    path = make_tiny_model(workdir / "models" / model, kv_heavy=TINY_MODELS[model])
    return str(path), model


def kv_transfer_config(
    engine: EngineConfig, connector: TopologyConnectorConfig, *, bind: str | None = None
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``engine`` (whose ``kv_port`` is resolved):
    its fabric server binds ``bind`` (default: the engine's address) and
    advertises the engine's address."""
    if engine.kv_port is None:
        raise ConfigError(f"{engine.name}.kv_port: not resolved")
    bind = engine.address if bind is None else bind
    extra = connector.extra_config(engine.kv_port, bind, role=engine.role, name=engine.name)
    if bind != engine.address:
        extra = {"advertise_host": engine.address, **extra}
    try:
        ConnectorConfig.check_extra(extra)
    except ConfigError as exc:
        raise ConfigError(f"{engine.name}: connector: {exc}") from exc
    return {
        "kv_connector": "FabricConnector",
        "kv_connector_module_path": "fabric.integrations.vllm",
        "kv_role": engine.kv_role,
        # A decoder whose KV does not arrive recomputes the prompt (vLLM's
        # default, "fail", would return an error to the client).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def engine_command(
    engine: EngineConfig, topology: TopologyConfig, *, template: dict[str, str] | None = None
) -> list[str]:
    """The command that starts ``engine``: its ``command`` template, else ``vllm serve``.
    ``template``: values that replace the template's own (a pod's ``host``, ``address``)."""
    assert engine.port is not None, "resolve_ports first"
    bind = engine_bind(topology, engine)
    kv_config = kv_transfer_config(engine, topology.connector, bind=bind)
    model, served = model_location(engine.model or "", topology.workdir_path)
    if engine.command is None:
        return vllm_serve_command(
            model,
            engine.port,
            kv_transfer_config=kv_config,
            extra_args=engine.args,
            served_model_name=None if "--served-model-name" in engine.args else served,
            host=bind,
        )
    values = {
        "host": bind,
        "address": engine.address,
        "port": str(engine.port),
        "kv_port": str(engine.kv_port),
        "name": engine.name,
        "role": engine.role,
        "model": served or model,
        "workdir": str(topology.workdir_path),
        "python": sys.executable,
        "kv_transfer_config": json.dumps(kv_config, separators=(",", ":")),
    } | (template or {})
    return [_fill(arg, values) for arg in [*engine.command, *engine.args]]


def drain_file(engine: EngineConfig, topology: TopologyConfig) -> Path:
    """Where ``engine`` records that it got SIGTERM and drains (``$FABRIC_DRAIN_FILE``)."""
    return topology.workdir_path / "run" / f"{engine.name}.draining"


def engine_environment(
    engine: EngineConfig,
    topology: TopologyConfig,
    *,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> dict[str, str]:
    """The engine's environment: offline vLLM settings, pinning, the drain
    file and timeout, its host's settings (:func:`~fabric.launch.hosts.host_environment`),
    then its ``env``."""
    env = engine_env(
        topology.workdir_path, cpu_cores=engine.cpu_cores, kv_cache_gib=engine.kv_cache_gib
    )
    env = host_environment(host_entry(topology, engine), env)
    if engine.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = engine.cuda_visible_devices
    env[DRAIN_FILE_ENV] = str(drain_file(engine, topology))
    env[DRAIN_TIMEOUT_ENV] = str(drain_timeout_s)
    return {**env, **engine.env}


def start_engines(
    topology: TopologyConfig,
    runs: list[EngineRun],
    options: UpOptions | None = None,
) -> None:
    """Start every launched engine (without waiting), appending each to ``runs``."""
    options = options or UpOptions()
    drain_timeout_s = options.drain_timeout(topology)
    logs = topology.workdir_path / "logs"
    # NOTE: every command first: a bad connector setting fails before any engine starts
    commands = {e.name: engine_command(e, topology) for e in topology.engines if e.launched}
    for engine in topology.engines:
        if not engine.launched:
            runs.append(EngineRun(engine))
            continue
        command = commands[engine.name]
        env = engine_environment(engine, topology, drain_timeout_s=drain_timeout_s)
        log_path = logs / f"{engine.name}.log"
        spawn = functools.partial(
            ManagedProcess, command, log_path=log_path, env=env, name=engine.name
        )
        child = Child(engine.name, spawn, options.restart, drain_file=drain_file(engine, topology))
        runs.append(EngineRun(engine, child))
        process = child.start()
        logger.info("started %s (pid %d): %s", engine.name, process.pid, " ".join(command))


def wait_healthy(runs: Sequence[EngineRun], timeout_s: float, announce: Announce) -> None:
    """Poll every engine's ``/health`` until all answer 200 (each one's child is
    marked serving as it answers).

    Raises ``ProcessExited`` when a launched engine dies and ``StartTimeout``
    after ``timeout_s``; both carry the engine's log tail.
    """
    started = time.monotonic()
    pending = list(runs)
    with httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
        while pending:
            for run in list(pending):
                _check_alive(run)
                if _answers_health(client, run.config):
                    pending.remove(run)
                    if run.child is not None:
                        run.child.serving(time.monotonic())
                    announce(
                        f"fabric up: {run.name} healthy after {time.monotonic() - started:.1f} s"
                    )
            if pending and time.monotonic() - started > timeout_s:
                raise StartTimeout(_timeout_message(pending, timeout_s))
            if pending:
                time.sleep(0.25)


def stop_timeout(drain_timeout_s: float) -> float:
    """How long an engine may take to stop after its SIGTERM: its drain, then vLLM's shutdown."""
    return drain_timeout_s + STOP_MARGIN_S


def stop_engines(runs: Sequence[EngineRun], timeout_s: float) -> None:
    """Stop every launched engine by pid, all at once (each SIGKILLed with its group
    after ``timeout_s``); return when all are gone."""
    threads = [
        threading.Thread(target=run.child.stop, args=(timeout_s,), name=f"stop-{run.name}")
        for run in runs
        if run.child is not None
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def store_endpoint_file(topology: TopologyConfig) -> Path:
    """Where the shared store writes its control endpoint (engines read it there)."""
    return topology.workdir_path / "run" / "store.endpoint"


def store_command(store: SharedStoreConfig, topology: TopologyConfig) -> list[str]:
    """``fabric store serve ...`` for the topology's shared store."""
    command = [sys.executable, "-m", "fabric.cli", "store", "serve"]
    command += ["--mem-gib", str(store.mem_gib), "--port", str(store.port)]
    command += ["--endpoint-file", str(store_endpoint_file(topology))]
    command += ["--transport", topology.connector.transport]
    if store.disk_path is not None:
        disk = Path(store.disk_path).expanduser().resolve()
        command += ["--disk-path", str(disk), "--disk-gib", str(store.disk_gib)]
    if topology.connector.secret_env is not None:
        command += ["--secret-env", topology.connector.secret_env]
    if topology.connector.insecure:
        command.append("--insecure")
    return command


def store_child(topology: TopologyConfig, options: UpOptions) -> Child:
    """The shared store as a supervised process; each start first removes a
    stale endpoint file (a store killed with SIGKILL leaves its own)."""
    store = topology.store
    assert store is not None
    command = store_command(store, topology)
    endpoint_file = store_endpoint_file(topology)
    log_path = topology.workdir_path / "logs" / "store.log"

    def spawn() -> ManagedProcess:
        endpoint_file.unlink(missing_ok=True)
        return ManagedProcess(command, log_path=log_path, name="store")

    if store.port:
        logger.info(
            "store.port %d is fixed: a restarted store comes back on the same endpoint", store.port
        )
    return Child("store", spawn, options.restart, ready_file=endpoint_file)


def start_store(
    topology: TopologyConfig, announce: Announce, options: UpOptions | None = None
) -> tuple[Child, str]:
    """Start the shared store and wait (bounded) for its endpoint file."""
    store = topology.store
    assert store is not None
    child = store_child(topology, options or UpOptions())
    process = child.start()
    endpoint_file = store_endpoint_file(topology)
    logger.info("started store (pid %d): %s", process.pid, " ".join(process.argv))
    deadline = time.monotonic() + store.startup_timeout_s
    try:
        while not endpoint_file.exists():
            if not process.alive():
                raise ProcessExited(
                    f"store (pid {process.pid}) exited with {process.returncode}; "
                    f"log {process.log_path}:\n{process.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise StartTimeout(
                    f"store: no endpoint within {store.startup_timeout_s:.0f} s; "
                    f"log {process.log_path}:\n{process.log_tail()}"
                )
            time.sleep(0.1)
    except BaseException:
        child.stop(STOP_MARGIN_S)
        raise
    child.serving(time.monotonic())
    endpoint = endpoint_file.read_text().strip()
    announce(f"fabric up: shared store serving on {endpoint}")
    return child, endpoint


def with_shared_store(topology: TopologyConfig, endpoint: str) -> TopologyConfig:
    """A copy whose engines get ``endpoint`` (a URL, or the path of the store's
    endpoint file) as their connector's ``shared_store``."""
    connector = topology.connector.model_copy(update={"shared_store": endpoint})
    return topology.model_copy(update={"connector": connector})


def up(topology: TopologyConfig, announce: Announce = say, options: UpOptions | None = None) -> int:
    """Run ``topology`` until SIGINT/SIGTERM/SIGHUP; 0 then, 1 if an engine or the
    proxy failed to start."""
    from fabric.router.serve import Shutdown

    options = options or UpOptions()
    placement = place(topology, options.host)
    runs: list[EngineRun] = []
    stores: list[Child] = []
    state_path = topology.workdir_path / "run" / "up.json"
    status = 1
    with UpSignals() as signals:
        try:
            try:
                _run(placement, announce, options, runs, stores)
                status = 0
            except Shutdown:
                status = 0
            except LaunchError as exc:
                signals.stopping = True
                print(f"fabric up: {exc}", file=sys.stderr, flush=True)
            finally:
                signals.stopping = True
                announce("fabric up: stopping")
                stop_engines(runs, stop_timeout(options.drain_timeout(topology)))
                for store in stores:
                    store.stop(STOP_MARGIN_S)
                state_path.unlink(missing_ok=True)
        except Shutdown:  # NOTE: a stop signal while a start failure was reported
            pass
    return status


def _run(
    placement: Placement,
    announce: Announce,
    options: UpOptions,
    runs: list[EngineRun],
    stores: list[Child],
) -> None:
    """Start the store and the engines (appended to ``stores`` and ``runs`` as they
    start, for the caller to stop), then serve until a stop signal and the drain:
    the proxy, or where it runs on another host, the engines alone."""
    topology = with_secret(placement.topology, announce)
    with _proxy_socket(topology) if placement.proxy else contextlib.nullcontext() as sock:
        resolved = resolve_ports(topology)
        store: Child | None = None
        if resolved.store is not None and _runs_store(placement):
            store, _ = start_store(resolved, announce, options)
            stores.append(store)
            # NOTE: the file, not the endpoint in it: engines and the proxy
            # resolve it at each call, so a restarted store (on a new
            # free port) is found again and attached to again.
            resolved = with_shared_store(resolved, str(store_endpoint_file(resolved)))
        start_engines(resolved, runs, options)
        logs = resolved.workdir_path / "logs"
        announce(f"fabric up: waiting for {len(runs)} engines (logs in {logs})")
        wait_healthy(runs, resolved.startup_timeout_s, announce)
        state_path = resolved.workdir_path / "run" / "up.json"
        running = Running(runs, store, state_path, options.drain_timeout(resolved))
        running.host = placement.host
        if sock is not None:
            serve_proxy(resolved, sock, running, announce)
            return
        running.proxy_here, running.proxy_url = False, placement.proxy_url
        serve_engines(running, announce)


def _runs_store(placement: Placement) -> bool:
    """Whether the shared store runs here: on its one host, or on each host that
    runs an engine (it is per host: engines find it by its endpoint file)."""
    return placement.host is None or any(e.launched for e in placement.topology.engines)


class UpSignals:
    """``fabric up``'s signal handlers, from start to exit.

    Until ``stopping``: SIGINT, SIGTERM and SIGHUP raise ``Shutdown`` (once);
    SIGUSR1 is ignored (nothing was drained yet). Once ``stopping``: all four
    are ignored. While the proxy serves, :func:`~fabric.launch.proxy_server.serve_drained`
    puts its own in their place. NOTE: Python handlers, not ``SIG_IGN``, which
    the engines started meanwhile would inherit.
    """

    HANDLED = (*STOP_SIGNALS, signal.SIGUSR1)

    def __init__(self) -> None:
        self.stopping = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> UpSignals:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.HANDLED}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        from fabric.router.serve import Shutdown

        if signum in STOP_SIGNALS and not self.stopping:
            self.stopping = True
            raise Shutdown(signum)


def main(config_path: str, announce: Announce = say, options: UpOptions | None = None) -> int:
    """``fabric up CONFIG``."""
    return up(load_topology(config_path), announce, options)


def _proxy_socket(topology: TopologyConfig) -> socket.socket:
    from fabric.router.admin import check_admin_exposure
    from fabric.router.serve import bind_socket

    host, port = topology.proxy_bind, topology.proxy.port
    check_admin_exposure(topology, host)
    try:
        return bind_socket(host, port)
    except OSError as exc:
        raise LaunchError(f"proxy: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def _check_alive(run: EngineRun) -> None:
    process = run.process
    if process is not None and not process.alive():
        raise ProcessExited(
            f"{run.name} (pid {process.pid}) exited with {process.returncode} before it was "
            f"healthy; log {process.log_path}:\n{process.log_tail()}"
        )


def _answers_health(client: httpx.Client, engine: EngineConfig) -> bool:
    try:
        return client.get(f"{engine.base_url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def _timeout_message(pending: Sequence[EngineRun], timeout_s: float) -> str:
    parts = [f"{', '.join(r.name for r in pending)} not healthy within {timeout_s:.0f} s"]
    for run in pending:
        if run.process is not None:
            parts.append(f"log {run.process.log_path}:\n{run.process.log_tail()}")
    return "\n".join(parts)


def _fill(arg: str, values: dict[str, str]) -> str:
    # NOTE: plain replacement, not str.format: args may hold JSON braces.
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg
