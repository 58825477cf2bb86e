"""Supervision under ``fabric up``: a process that exits is restarted with backoff.

Every process ``fabric up`` started (each launched engine, the shared store)
is a :class:`Child`. The :class:`Supervisor` looks at them every ``TICK_S``
on the proxy's event loop, so it can change the proxy's engine objects
directly::

    up / starting --process exits--> down
        the proxy's engine is marked down at once ("process exited with
        signal SIGKILL"); logged with the exit, the restart number, the log
        path and its tail; whatever is left in its process group gets
        SIGKILL (a vLLM API server killed alone leaves its EngineCore and
        workers running, with their memory and the bound kv_port)
          | wait the backoff: initial_s, doubled at each exit up to max_s;
          | back to initial_s once the process stayed up reset_after_s;
          | and until the old group is gone (at most GROUP_GONE_TIMEOUT_S,
          | then restarted anyway, with an error logged)
          v
    starting: the same command, ports, environment and log file (appended)
          | the proxy's health probe marks the engine up (the store: its
          | endpoint file is back)
          v
    up: restart_to_serving_s = now - the exit (the first one of a crash
        loop), logged and kept as last_restart_to_serving_s, with
        last_restart_boot_s = now - the spawn that came up (the part the
        program's own start took; the rest is fabric up's: noticing the
        exit, the backoff, reaping the old group); the first time:
        first_start_s = now - the first spawn

    up --its drain file appears--> draining
        the engine got SIGTERM and drains itself (:mod:`fabric.launch.drain`);
        the proxy stops routing to it at once
    draining --process exits--> stopped: drained on purpose, not restarted
        (unless ``restart_drained``, or :meth:`Supervisor.restart_stopped`:
        SIGUSR1 to ``fabric up``)

A crash loop never spins: each exit waits longer, up to ``max_s``, and the
engine shows as down meanwhile. An engine that stays alive but stops
answering is the health probe's business (down until it answers again),
not a restart.

Every ``TICK_S`` the supervisor first looks at every process (exits,
restarts, drain files: no I/O, never waits), then starts the readiness
probes of the live ones, all at once, unless the last round still runs: a
slow probe never delays marking an exit down.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import model_validator

from fabric.settings import Settings

if TYPE_CHECKING:
    from fabric.launch.process import ManagedProcess
    from fabric.router.engines import Engine

logger = logging.getLogger(__name__)

TICK_S = 0.2
GROUP_GONE_TIMEOUT_S = 30.0  # a restart waits at most this for the old group to be gone


class ChildState(enum.Enum):
    """What a supervised process is doing (``up.json``'s ``state``)."""

    STARTING = "starting"  # (re)started, not healthy yet
    UP = "up"
    DOWN = "down"  # exited and waiting for its restart, or alive and failing its probe
    DRAINING = "draining"  # got SIGTERM: finishing what it has
    STOPPED = "stopped"  # drained on purpose and exited; not restarted


class RestartPolicy(Settings):
    """Backoff of restarts: ``initial_s`` doubling to ``max_s``, reset after
    ``reset_after_s`` up; ``restart_drained``: restart engines drained on purpose too."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0
    restart_drained: bool = False

    @model_validator(mode="after")
    def _check(self) -> RestartPolicy:
        if not self.initial_s > 0:
            raise ValueError(f"--restart-backoff-s: must be > 0, got {self.initial_s}")
        if not self.max_s >= self.initial_s:
            raise ValueError(
                f"--restart-backoff-max-s: must be >= --restart-backoff-s ({self.initial_s}), "
                f"got {self.max_s}"
            )
        if not self.reset_after_s > 0:
            raise ValueError(f"reset_after_s: must be > 0, got {self.reset_after_s}")
        return self


@dataclass(frozen=True)
class ExitRecord:
    """How a process ended: its pid, exit status (negative: the signal) and when."""

    pid: int
    returncode: int
    at: float  # wall clock

    @property
    def how(self) -> str:
        """``exit code 3`` or ``signal SIGKILL``."""
        if self.returncode >= 0:
            return f"exit code {self.returncode}"
        try:
            return f"signal {signal.Signals(-self.returncode).name}"
        except ValueError:
            return f"signal {-self.returncode}"

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "returncode": self.returncode, "how": self.how, "at": self.at}


class Child:
    """One process ``fabric up`` keeps running: an engine (``engine`` set once
    the proxy exists) or the shared store."""

    def __init__(
        self,
        name: str,
        spawn: Callable[[], ManagedProcess],
        policy: RestartPolicy,
        *,
        drain_file: Path | None = None,
        ready_file: Path | None = None,
    ) -> None:
        self.name = name
        self.spawn = spawn
        self.policy = policy
        self.drain_file = drain_file
        self.ready_file = ready_file  # the store: its endpoint file, written once it serves
        self.process: ManagedProcess | None = None
        self.engine: Engine | None = None
        self.state = ChildState.STARTING
        self.restarts = 0
        self.last_exit: ExitRecord | None = None
        self.last_restart_to_serving_s: float | None = None
        self.last_restart_boot_s: float | None = None
        self.first_start_s: float | None = None
        self.log_path: Path | None = None
        self._backoff_s = policy.initial_s
        self._first_spawn_at: float | None = None
        self._spawned_at: float | None = None
        self._leftovers: list[ManagedProcess] = []  # exited, their group not gone yet
        self._leftovers_until: float | None = None
        self._restart_at: float | None = None
        self._exited_at: float | None = None
        self._up_since: float | None = None

    def start(self, now: float | None = None) -> ManagedProcess:
        """Start the process (its stale drain file removed first)."""
        if self.drain_file is not None:
            self.drain_file.unlink(missing_ok=True)
        self.process = self.spawn()
        self.log_path = self.process.log_path
        self._spawned_at = time.monotonic() if now is None else now
        if self._first_spawn_at is None:
            self._first_spawn_at = self._spawned_at
        return self.process

    def stop(self, timeout: float) -> None:
        """Stop the process if it runs (``ManagedProcess.stop``), and kill what is
        left of the groups of the processes that exited before; it is not restarted."""
        self._restart_at = None
        if self.process is not None:
            self.process.stop(timeout)
        for process in self._leftovers:
            process.kill_group()
        for process in self._leftovers:
            if not process.wait_group_gone(GROUP_GONE_TIMEOUT_S):
                logger.error(
                    "%s: processes %s of the group of pid %d outlived SIGKILL",
                    self.name, process.group_pids(), process.pid,
                )  # fmt: skip
        self._leftovers = []

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def step(self, now: float, ready: bool) -> bool:
        """Advance by one look at the process (``ready``: it serves); True if anything changed."""
        return self.watch(now) or self.update(now, ready)

    def watch(self, now: float) -> bool:
        """Look at the process without asking it anything: an exit, a restart due,
        a drain file; True if anything changed."""
        if self.process is None:
            if self._restart_at is None or now < self._restart_at:
                return False
            if not self._leftovers_gone(now):
                return False
            self._restart(now)
            return True
        if not self.process.alive():
            self._exited(now)
            return True
        if self.state is not ChildState.DRAINING and self._drain_requested():
            self._draining()
            return True
        return False

    def update(self, now: float, ready: bool) -> bool:
        """Take in whether the live process serves (its readiness probe); True if that changed."""
        if self.process is None or not self.process.alive():
            return False  # watch() takes the exit
        return self._update(now, ready)

    def restart_when_stopped(self, now: float) -> bool:
        """Restart a stopped (drained) process at the next step; True if it was stopped."""
        if self.state is not ChildState.STOPPED:
            return False
        self.state = ChildState.DOWN
        self._restart_at = now
        self._exited_at = now
        self._backoff_s = self.policy.initial_s
        return True

    def as_dict(self) -> dict[str, Any]:
        """Its entry fields in ``up.json``."""
        return {
            "pid": self.process.pid if self.process is not None else None,
            "log": str(self.log_path) if self.log_path is not None else None,
            "state": self.state.value,
            "restarts": self.restarts,
            "last_exit": self.last_exit.as_dict() if self.last_exit is not None else None,
            "last_restart_to_serving_s": self.last_restart_to_serving_s,
            "last_restart_boot_s": self.last_restart_boot_s,
            "first_start_s": self.first_start_s,
        }

    def _update(self, now: float, ready: bool) -> bool:
        if self.state is ChildState.DRAINING:
            return False
        if ready and self.state in (ChildState.STARTING, ChildState.DOWN):
            self.serving(now)
            return True
        if not ready and self.state is ChildState.UP:
            self.state = ChildState.DOWN
            self._up_since = None
            return True
        if self._up_since is not None and now - self._up_since >= self.policy.reset_after_s:
            self._backoff_s = self.policy.initial_s
        return False

    def serving(self, now: float) -> None:
        """It serves (fabric up's start wait saw it healthy, or the proxy's probe)."""
        self.state = ChildState.UP
        self._up_since = now
        if self.first_start_s is None and self._first_spawn_at is not None:
            self.first_start_s = round(now - self._first_spawn_at, 3)
        if self._exited_at is not None:
            self.last_restart_to_serving_s = round(now - self._exited_at, 3)
            self._exited_at = None
            boot = None if self._spawned_at is None else round(now - self._spawned_at, 3)
            self.last_restart_boot_s = boot
            logger.warning(
                "%s is serving again %.1f s after it exited (restart %d; its own start "
                "took %s s of that)",
                self.name, self.last_restart_to_serving_s, self.restarts,
                "?" if boot is None else f"{boot:.1f}",
            )  # fmt: skip

    def _exited(self, now: float) -> None:
        process = self.process
        assert process is not None
        record = ExitRecord(process.pid, process.returncode or 0, time.time())
        self.last_exit, self.process, self._up_since = record, None, None
        if self._exited_at is None:
            self._exited_at = now
        drained = self.state is ChildState.DRAINING or self._drain_requested()
        self._mark_down(f"process exited with {record.how}" + (" (drained)" if drained else ""))
        self._kill_leftovers(process, now)
        if drained and not self.policy.restart_drained:
            self.state = ChildState.STOPPED
            logger.warning(
                "%s (pid %d) drained and exited with %s; not restarted (SIGUSR1 to fabric up "
                "restarts it); log %s",
                self.name, record.pid, record.how, process.log_path,
            )  # fmt: skip
            return
        delay = self._schedule(now)
        logger.error(
            "%s (pid %d) exited with %s; restart %d in %.1f s; log %s:\n%s",
            self.name, record.pid, record.how, self.restarts + 1, delay,
            process.log_path, process.log_tail(),
        )  # fmt: skip

    def _kill_leftovers(self, process: ManagedProcess, now: float) -> None:
        """SIGKILL what the exited process left in its group (its restart waits for it)."""
        left = process.kill_group()
        if not left:
            return
        self._leftovers.append(process)
        self._leftovers_until = now + GROUP_GONE_TIMEOUT_S
        logger.warning(
            "%s (pid %d) exited and left %d processes in its group (pids %s): SIGKILL",
            self.name, process.pid, len(left), " ".join(map(str, left)),
        )  # fmt: skip

    def _leftovers_gone(self, now: float) -> bool:
        """Whether the groups of the exited processes are gone (or waited for long enough)."""
        # NOTE: SIGKILL again, in case one forked meanwhile.
        self._leftovers = [p for p in self._leftovers if p.kill_group()]
        if not self._leftovers or self._leftovers_until is None:
            return True
        if now < self._leftovers_until:
            return False
        self._leftovers_until = None  # NOTE: kept in _leftovers: stop() kills them again
        logger.error(
            "%s: processes %s of the group of pid %d still run %.0f s after SIGKILL; "
            "restarting anyway (its ports may still be taken)",
            self.name, self._leftovers[0].group_pids(), self._leftovers[0].pid,
            GROUP_GONE_TIMEOUT_S,
        )  # fmt: skip
        return True

    def _schedule(self, now: float) -> float:
        delay = self._backoff_s
        self._backoff_s = min(2 * delay, self.policy.max_s)
        self._restart_at = now + delay
        self.state = ChildState.DOWN
        return delay

    def _restart(self, now: float) -> None:
        self._restart_at = None
        number = self.restarts + 1
        if self.log_path is not None:
            _append_line(self.log_path, f"---- fabric up: restart {number} of {self.name} ----")
        try:
            process = self.start(now)
        except OSError as exc:
            delay = self._schedule(now)
            logger.error(
                "%s: restart %d failed (%s); next in %.1f s", self.name, number, exc, delay
            )
            return
        self.restarts = number
        self.state = ChildState.STARTING
        self._mark_down(f"restarting (restart {number})")
        self._set_draining(False)
        logger.warning(
            "restarted %s (pid %d), restart %d; log %s",
            self.name, process.pid, number, process.log_path,
        )  # fmt: skip

    def _draining(self) -> None:
        self.state = ChildState.DRAINING
        logger.warning("%s got SIGTERM and drains; the proxy stops routing to it", self.name)
        if not self._set_draining(True):
            self._mark_down("draining (its process got SIGTERM)")

    def _drain_requested(self) -> bool:
        return self.drain_file is not None and self.drain_file.exists()

    def _mark_down(self, reason: str) -> None:
        if self.engine is not None:
            self.engine.mark_down(reason)

    def _set_draining(self, draining: bool) -> bool:
        """``Engine.set_draining`` once the proxy knows the engine (False before)."""
        if self.engine is None:
            return False
        self.engine.set_draining(draining)
        return True


Ready = Callable[[Child], Awaitable[bool]]


class Supervisor:
    """Looks at every child every ``TICK_S`` and probes the live ones (see the
    module docstring); ``on_change()`` after any change (up.json)."""

    def __init__(self, children: Sequence[Child], ready: Ready, on_change: Callable[[], None]):
        self.children = list(children)
        self.ready = ready
        self.on_change = on_change

    async def run(self) -> None:
        """Supervise until cancelled."""
        probes: asyncio.Task[None] | None = None
        try:
            while True:
                await asyncio.sleep(TICK_S)
                self.watch()
                if probes is None or probes.done():
                    probes = asyncio.create_task(self.probe(), name="fabric-up-probes")
        finally:
            if probes is not None:
                probes.cancel()

    async def tick(self) -> None:
        """One look at every child, then one round of probes."""
        self.watch()
        await self.probe()

    def watch(self) -> None:
        """Exits, restarts due and drain files of every child; never waits."""
        changed = False
        for child in self.children:
            try:
                changed |= child.watch(time.monotonic())
            except Exception:
                logger.exception("supervising %s failed (will look again)", child.name)
        if changed:
            self._changed()

    async def probe(self) -> None:
        """Probe every live child at once, then take in each answer for the
        process it was asked about (one that exited meanwhile is watch()'s)."""
        asked = [(child, child.process) for child in self.children if child.alive()]
        answers = await asyncio.gather(
            *(self.ready(child) for child, _ in asked), return_exceptions=True
        )
        changed = False
        for (child, process), answer in zip(asked, answers, strict=True):
            if isinstance(answer, BaseException):
                logger.error("probing %s failed (will ask again)", child.name, exc_info=answer)
            elif child.process is process:
                try:
                    changed |= child.update(time.monotonic(), bool(answer))
                except Exception:
                    logger.exception("supervising %s failed (will look again)", child.name)
        if changed:
            self._changed()

    def restart_stopped(self) -> None:
        """Restart every child that was drained on purpose and stopped (SIGUSR1)."""
        now = time.monotonic()
        names = [c.name for c in self.children if c.restart_when_stopped(now)]
        logger.warning("SIGUSR1: restarting %s", ", ".join(names) or "nothing (none stopped)")
        if names:
            self._changed()

    def _changed(self) -> None:
        try:
            self.on_change()
        except OSError:
            logger.exception("could not record the new state")


def _append_line(path: Path, line: str) -> None:
    try:
        with open(path, "a") as log:
            log.write(f"\n{line}\n")
    except OSError:
        pass
