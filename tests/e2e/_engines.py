"""Real vLLM engines for e2e tests: start on a free loopback port, wait, stop by pid."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric.launch.process import (
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
    wait_http_ok,
)

# NOTE: 15-40 s on an idle 2-core machine; much more while other engines start.
START_TIMEOUT_S = 240.0
SERVED_MODEL_NAME = "tiny"


@dataclass
class Engine:
    """One running ``vllm serve`` process and where to reach it."""

    process: ManagedProcess
    port: int
    model: str
    start_s: float

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        """Absolute URL of ``path`` on this engine."""
        return self.base_url + path


def start_engine(
    model_dir: Path,
    workdir: Path,
    *,
    name: str = "engine",
    kv_transfer_config: dict[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    cpu_cores: str | None = None,
    kv_cache_gib: int = 1,
    timeout: float = START_TIMEOUT_S,
) -> Engine:
    """Start ``vllm serve model_dir`` and return once ``/health`` answers 200.

    The process is stopped again if it does not come up.
    """
    port = free_port()
    argv = vllm_serve_command(
        model_dir,
        port,
        kv_transfer_config=kv_transfer_config,
        extra_args=extra_args,
        served_model_name=SERVED_MODEL_NAME,
    )
    env = engine_env(workdir, cpu_cores=cpu_cores, kv_cache_gib=kv_cache_gib)
    started = time.monotonic()
    process = ManagedProcess(
        argv, log_path=workdir / f"{name}.log", env=env, cwd=workdir, name=name
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout, process)
    except BaseException:
        process.stop()
        raise
    return Engine(process, port, SERVED_MODEL_NAME, time.monotonic() - started)


class EngineFactory:
    """Starts engines and remembers them, so a fixture can stop every one by pid.

    ``start`` may be called from several threads to start engines in parallel.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._engines: list[Engine] = []
        self._lock = threading.Lock()
        self._counter = itertools.count()

    def start(self, model_dir: Path, *, name: str = "engine", **kwargs: Any) -> Engine:
        """``start_engine`` (same keywords) in a fresh work dir under the factory's root."""
        with self._lock:
            workdir = self._root / f"{name}-{next(self._counter)}"
        workdir.mkdir(parents=True)
        engine = start_engine(model_dir, workdir, name=name, **kwargs)
        with self._lock:
            self._engines.append(engine)
        return engine

    def start_many(self, model_dir: Path, specs: dict[str, dict[str, Any]]) -> dict[str, Engine]:
        """Start one engine per ``{name: start keywords}`` in parallel; all up, or raise.

        Engines start mostly in single-threaded imports, so two start on two
        cores in about the time of one; more take longer in proportion, and
        each is given ``START_TIMEOUT_S`` per two started at once (unless its
        keywords give a ``timeout``): five took 4-5 minutes to come up on a
        2-core machine whose CPU ran the tiny model several times slower.
        """
        timeout = START_TIMEOUT_S * max(1.0, len(specs) / 2)
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(
                    self.start, model_dir, name=name, **{"timeout": timeout, **kwargs}
                )
                for name, kwargs in specs.items()
            }
            return {name: future.result() for name, future in futures.items()}

    def corrupt_at_use(self) -> dict[str, float]:
        """Engines still running whose ``vllm:fabric_corrupt_chunks_total`` is
        not 0 (a chunk failed its checksum when it was used): name -> count."""
        import httpx

        found = {}
        with self._lock:
            engines = list(self._engines)
        for engine in engines:
            if not engine.process.alive():
                continue
            try:
                text = httpx.get(engine.url("/metrics"), timeout=30).text
            except httpx.HTTPError:
                continue
            count = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:fabric_corrupt_chunks_total")
            )
            if count:
                found[f"{engine.process.name} ({engine.base_url})"] = count
        return found

    def stop_all(self) -> None:
        """Stop every engine this factory started (SIGTERM, then SIGKILL, by group)."""
        with self._lock:
            engines, self._engines = self._engines, []
        for engine in reversed(engines):
            engine.process.stop()
