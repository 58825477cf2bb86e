"""``fabric up CONFIG``: start a topology's engines and its proxy; stop them on a signal.

::

    load YAML -> bind the proxy socket (a taken port fails before anything starts)
              -> with a ``store:`` section: start the shared store
                 (``fabric store serve``, log WORKDIR/logs/store.log), wait for
                 its endpoint, hand it to every engine as ``shared_store``
              -> choose free ports, build the tiny model if named
              -> start every engine (all at once), logs in WORKDIR/logs/NAME.log
              -> wait until every /health answers (bounded; on failure print
                 that engine's log tail and stop everything)
              -> serve the proxy in this process, print its URL,
                 write WORKDIR/run/up.json (pids, URLs)
    SIGINT/SIGTERM -> stop the proxy, then every engine by pid (process group),
                      then the shared store

The proxy runs in this process rather than as a child: its lifetime is the
launcher's, one signal handler stops everything in order, and there is no
extra interpreter to start, health-wait or leak.

Models: ``tiny`` and ``tiny-kv-heavy`` name the local random-weight Llamas at
``WORKDIR/models/NAME``, built by ``fabric.models.tiny.make_tiny_model`` when
missing and served under that name. Anything else goes to vLLM as is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fabric.config import (
    ConnectorConfig,
    EngineConfig,
    SharedStoreConfig,
    TopologyConfig,
    load_topology,
)
from fabric.errors import ConfigError, LaunchError, ProcessExited, StartTimeout
from fabric.launch.process import (
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
)

logger = logging.getLogger(__name__)

TINY_MODELS = {"tiny": False, "tiny-kv-heavy": True}  # name -> kv_heavy
STOP_TIMEOUT_S = 30.0
Announce = Callable[[str], None]


def say(message: str) -> None:
    """Print one progress line at once (stdout may be a pipe)."""
    print(message, flush=True)


@dataclass
class EngineRun:
    """An engine of the running topology; ``process`` is None for a ``url`` engine."""

    config: EngineConfig
    process: ManagedProcess | None = None

    @property
    def name(self) -> str:
        """The engine's name."""
        return self.config.name


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
    from fabric.models.tiny import make_tiny_model

    logger.info("model %s: %s (built if missing)", model, workdir / "models" / model)
    path = make_tiny_model(workdir / "models" / model, kv_heavy=TINY_MODELS[model])
    return str(path), model


def kv_transfer_config(engine: EngineConfig, connector: ConnectorConfig) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``engine`` (whose ``kv_port`` is resolved)."""
    if engine.kv_port is None:
        raise ConfigError(f"{engine.name}.kv_port: not resolved")
    return {
        "kv_connector": "FabricConnector",
        "kv_connector_module_path": "fabric.integrations.vllm",
        "kv_role": engine.kv_role,
        # A decoder whose KV does not arrive recomputes the prompt (vLLM's
        # default, "fail", would return an error to the client).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": connector.extra_config(
            engine.kv_port, engine.host, role=engine.role, name=engine.name
        ),
    }


def engine_command(engine: EngineConfig, topology: TopologyConfig) -> list[str]:
    """The command that starts ``engine``: its ``command`` template, else ``vllm serve``."""
    assert engine.port is not None, "resolve_ports first"
    kv_config = kv_transfer_config(engine, topology.connector)
    model, served = model_location(engine.model or "", topology.workdir_path)
    if engine.command is None:
        return vllm_serve_command(
            model,
            engine.port,
            kv_transfer_config=kv_config,
            extra_args=engine.args,
            served_model_name=None if "--served-model-name" in engine.args else served,
        )
    values = {
        "port": str(engine.port),
        "kv_port": str(engine.kv_port),
        "name": engine.name,
        "role": engine.role,
        "model": served or model,
        "workdir": str(topology.workdir_path),
        "python": sys.executable,
        "kv_transfer_config": json.dumps(kv_config, separators=(",", ":")),
    }
    return [_fill(arg, values) for arg in [*engine.command, *engine.args]]


def engine_environment(engine: EngineConfig, topology: TopologyConfig) -> dict[str, str]:
    """The engine's environment: offline vLLM settings, pinning, then its ``env``."""
    env = engine_env(
        topology.workdir_path, cpu_cores=engine.cpu_cores, kv_cache_gib=engine.kv_cache_gib
    )
    if engine.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = engine.cuda_visible_devices
    return {**env, **engine.env}


def start_engines(topology: TopologyConfig, runs: list[EngineRun]) -> None:
    """Start every launched engine (without waiting), appending each to ``runs``."""
    logs = topology.workdir_path / "logs"
    for engine in topology.engines:
        if not engine.launched:
            runs.append(EngineRun(engine))
            continue
        command = engine_command(engine, topology)
        env = engine_environment(engine, topology)
        log_path = logs / f"{engine.name}.log"
        process = ManagedProcess(command, log_path=log_path, env=env, name=engine.name)
        runs.append(EngineRun(engine, process))
        logger.info("started %s (pid %d): %s", engine.name, process.pid, " ".join(command))


def wait_healthy(runs: Sequence[EngineRun], timeout_s: float, announce: Announce) -> None:
    """Poll every engine's ``/health`` until all answer 200.

    Raises ``ProcessExited`` when a launched engine dies and ``StartTimeout``
    after ``timeout_s``; both carry the engine's log tail.
    """
    started = time.monotonic()
    pending = list(runs)
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            for run in list(pending):
                _check_alive(run)
                if _answers_health(client, run.config):
                    pending.remove(run)
                    announce(
                        f"fabric up: {run.name} healthy after {time.monotonic() - started:.1f} s"
                    )
            if pending and time.monotonic() - started > timeout_s:
                raise StartTimeout(_timeout_message(pending, timeout_s))
            if pending:
                time.sleep(0.25)


def stop_engines(runs: Sequence[EngineRun]) -> None:
    """Stop every launched engine by pid, all at once; return when all are gone."""
    threads = [
        threading.Thread(target=run.process.stop, args=(STOP_TIMEOUT_S,), name=f"stop-{run.name}")
        for run in runs
        if run.process is not None
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def store_command(store: SharedStoreConfig, topology: TopologyConfig) -> list[str]:
    """``fabric store serve ...`` for the topology's shared store."""
    endpoint_file = topology.workdir_path / "run" / "store.endpoint"
    command = [sys.executable, "-m", "fabric.cli", "store", "serve"]
    command += ["--mem-gib", str(store.mem_gib), "--port", str(store.port)]
    command += ["--endpoint-file", str(endpoint_file)]
    command += ["--transport", topology.connector.transport]
    if store.disk_path is not None:
        disk = Path(store.disk_path).expanduser().resolve()
        command += ["--disk-path", str(disk), "--disk-gib", str(store.disk_gib)]
    if topology.connector.secret_env is not None:
        command += ["--secret-env", topology.connector.secret_env]
    return command


def start_store(topology: TopologyConfig, announce: Announce) -> tuple[ManagedProcess, str]:
    """Start the shared store and wait (bounded) for its endpoint file."""
    store = topology.store
    assert store is not None
    endpoint_file = topology.workdir_path / "run" / "store.endpoint"
    endpoint_file.unlink(missing_ok=True)
    command = store_command(store, topology)
    log_path = topology.workdir_path / "logs" / "store.log"
    process = ManagedProcess(command, log_path=log_path, name="store")
    logger.info("started store (pid %d): %s", process.pid, " ".join(command))
    deadline = time.monotonic() + store.startup_timeout_s
    try:
        while not endpoint_file.exists():
            if not process.alive():
                raise ProcessExited(
                    f"store (pid {process.pid}) exited with {process.returncode}; "
                    f"log {log_path}:\n{process.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise StartTimeout(
                    f"store: no endpoint within {store.startup_timeout_s:.0f} s; "
                    f"log {log_path}:\n{process.log_tail()}"
                )
            time.sleep(0.1)
    except BaseException:
        process.stop(STOP_TIMEOUT_S)
        raise
    endpoint = endpoint_file.read_text().strip()
    announce(f"fabric up: shared store serving on {endpoint}")
    return process, endpoint


def with_shared_store(topology: TopologyConfig, endpoint: str) -> TopologyConfig:
    """A copy whose engines get ``endpoint`` as their connector's ``shared_store``."""
    connector = topology.connector.model_copy(update={"shared_store": endpoint})
    return topology.model_copy(update={"connector": connector})


def up(topology: TopologyConfig, announce: Announce = say) -> int:
    """Run ``topology`` until SIGINT/SIGTERM; 0 then, 1 if an engine failed to start."""
    from fabric.router.serve import Shutdown, shutdown_on_signals, signals_ignored

    runs: list[EngineRun] = []
    store: ManagedProcess | None = None
    state_path = topology.workdir_path / "run" / "up.json"
    try:
        with _proxy_socket(topology) as sock, shutdown_on_signals():
            resolved = resolve_ports(topology)
            if resolved.store is not None:
                store, endpoint = start_store(resolved, announce)
                resolved = with_shared_store(resolved, endpoint)
            start_engines(resolved, runs)
            logs = resolved.workdir_path / "logs"
            announce(f"fabric up: waiting for {len(runs)} engines (logs in {logs})")
            wait_healthy(runs, resolved.startup_timeout_s, announce)
            _serve_proxy(resolved, sock, runs, state_path, announce)
    except Shutdown:
        pass
    except LaunchError as exc:
        print(f"fabric up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        with signals_ignored():
            announce("fabric up: stopping")
            stop_engines(runs)
            if store is not None:
                store.stop(STOP_TIMEOUT_S)
            state_path.unlink(missing_ok=True)
    return 0


def main(config_path: str, announce: Announce = say) -> int:
    """``fabric up CONFIG``."""
    return up(load_topology(config_path), announce)


def _proxy_socket(topology: TopologyConfig) -> socket.socket:
    from fabric.router.serve import bind_socket

    host, port = topology.proxy.host, topology.proxy.port
    try:
        return bind_socket(host, port)
    except OSError as exc:
        raise LaunchError(f"proxy: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def _serve_proxy(
    topology: TopologyConfig,
    sock: socket.socket,
    runs: Sequence[EngineRun],
    state_path: Path,
    announce: Announce,
) -> None:
    from fabric.router import create_app
    from fabric.router.serve import run_loop, serve_app

    app = create_app(topology)

    def on_started(url: str) -> None:
        _write_state(state_path, url, runs)
        announce(f"fabric up: proxy ready at {url} (Ctrl-C stops everything)")

    async def serve() -> None:
        watcher = asyncio.create_task(_watch(runs))
        try:
            await serve_app(app, sock, on_started)
        finally:
            watcher.cancel()

    run_loop(serve())


async def _watch(runs: Sequence[EngineRun]) -> None:
    """Log (once) each launched engine that dies while the proxy serves."""
    reported: set[str] = set()
    while True:
        await asyncio.sleep(1.0)
        for run in runs:
            if run.process is not None and not run.process.alive() and run.name not in reported:
                reported.add(run.name)
                logger.error(
                    "engine %s (pid %d) exited with %s; log %s:\n%s",
                    run.name, run.process.pid, run.process.returncode,
                    run.process.log_path, run.process.log_tail(),
                )  # fmt: skip


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


def _write_state(path: Path, proxy_url: str, runs: Sequence[EngineRun]) -> None:
    engines = [
        {
            "name": run.name,
            "role": run.config.role,
            "url": run.config.base_url,
            "kv_endpoint": run.config.kv_endpoint,
            "pid": run.process.pid if run.process is not None else None,
            "log": str(run.process.log_path) if run.process is not None else None,
        }
        for run in runs
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"proxy_url": proxy_url, "engines": engines}, indent=2) + "\n")
    tmp.replace(path)


def _fill(arg: str, values: dict[str, str]) -> str:
    # NOTE: plain replacement, not str.format: args may hold JSON braces.
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg
