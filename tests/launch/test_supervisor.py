"""The supervisor's decisions, step by step, with stand-in processes and the proxy's Engine."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from fabric.errors import ConfigError
from fabric.launch.supervisor import Child, ChildState, ExitRecord, RestartPolicy, Supervisor
from fabric.router.engines import Engine

PIDS = itertools.count(1000)


class StandIn:
    """What the supervisor uses of a ManagedProcess."""

    def __init__(self, log_path: Path) -> None:
        self.pid = next(PIDS)
        self.log_path = log_path
        self.returncode: int | None = None
        self.argv = ["stand-in"]

    def alive(self) -> bool:
        return self.returncode is None

    def log_tail(self) -> str:
        return "last words"

    def stop(self, timeout: float = 0) -> int | None:
        if self.returncode is None:
            self.returncode = -15
        return self.returncode


def child(tmp_path: Path, policy: RestartPolicy | None = None) -> tuple[Child, list[StandIn]]:
    spawned: list[StandIn] = []

    def spawn() -> StandIn:
        spawned.append(StandIn(tmp_path / "e.log"))
        return spawned[-1]

    c = Child("decode-0", spawn, policy or RestartPolicy(), drain_file=tmp_path / "drain")  # type: ignore[arg-type]
    c.engine = Engine("decode-0", "decode", "http://127.0.0.1:1", "tcp://127.0.0.1:2")
    c.start()
    c.serving(0.0)
    return c, spawned


def restart_times(c: Child, spawned: list[StandIn], exits: int) -> list[float]:
    """Kill the process at once after each (re)start; the times the restarts happen."""
    times, now = [], 0.0
    for _ in range(exits):
        spawned[-1].returncode = 3
        c.step(now, ready=False)
        count = len(spawned)
        while len(spawned) == count:
            now = round(now + 0.1, 1)
            c.step(now, ready=False)
        times.append(now)
    return times


def test_an_exit_marks_the_engine_down_at_once_and_restarts_it_after_the_backoff(
    tmp_path: Path,
) -> None:
    c, spawned = child(tmp_path)
    spawned[0].returncode = -9

    assert c.step(0.1, ready=True)
    assert c.engine is not None and not c.engine.healthy
    assert c.engine.last_error == "process exited with signal SIGKILL"
    assert c.state is ChildState.DOWN and c.restarts == 0 and c.process is None
    assert not c.step(1.0, ready=True)  # 1 s from the exit: not yet
    assert c.step(1.1, ready=True)
    assert len(spawned) == 2 and c.restarts == 1 and c.state is ChildState.STARTING
    assert c.step(1.6, ready=True)
    assert c.state is ChildState.UP and c.last_restart_to_serving_s == 1.5
    assert c.last_exit is not None
    assert c.last_exit == ExitRecord(spawned[0].pid, -9, c.last_exit.at)
    assert c.as_dict()["pid"] == spawned[1].pid and c.as_dict()["restarts"] == 1


def test_a_crash_loop_doubles_the_wait_up_to_the_cap(tmp_path: Path) -> None:
    c, spawned = child(tmp_path, RestartPolicy(initial_s=1, max_s=8))
    times = restart_times(c, spawned, 6)
    waits = [round(b - a, 1) for a, b in zip([0.0, *times], times, strict=False)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert c.restarts == 6


def test_the_backoff_starts_over_once_the_process_stayed_up(tmp_path: Path) -> None:
    c, spawned = child(tmp_path, RestartPolicy(initial_s=1, max_s=8, reset_after_s=10))
    restart_times(c, spawned, 3)  # next wait would be 8 s
    c.step(100.0, ready=True)  # up
    c.step(111.0, ready=True)  # up for 11 s
    spawned[-1].returncode = 1
    c.step(112.0, ready=True)
    assert not c.step(112.9, ready=True)
    assert c.step(113.0, ready=True) and c.restarts == 4


def test_an_engine_drained_on_purpose_stays_stopped_until_asked(tmp_path: Path) -> None:
    c, spawned = child(tmp_path)
    assert c.engine is not None
    (tmp_path / "drain").write_text("{}")

    assert c.step(0.1, ready=True)
    assert c.state is ChildState.DRAINING and not c.engine.routable
    spawned[0].returncode = 0
    c.step(0.2, ready=False)
    assert c.state is ChildState.STOPPED
    assert not any(c.step(t, ready=False) for t in (5.0, 60.0, 600.0))
    assert len(spawned) == 1

    assert c.restart_when_stopped(601.0)
    c.step(601.0, ready=False)
    assert len(spawned) == 2 and c.state is ChildState.STARTING
    assert not (tmp_path / "drain").exists()  # removed before the new process starts
    assert not c.engine.draining


def test_restart_drained_restarts_a_drained_engine_like_a_crashed_one(tmp_path: Path) -> None:
    c, spawned = child(tmp_path, RestartPolicy(restart_drained=True))
    (tmp_path / "drain").write_text("{}")
    c.step(0.1, ready=True)
    spawned[0].returncode = 0
    c.step(0.2, ready=False)
    c.step(1.3, ready=False)
    assert c.state is ChildState.STARTING and len(spawned) == 2


def test_a_live_engine_that_fails_its_probe_is_down_not_restarted(tmp_path: Path) -> None:
    c, spawned = child(tmp_path)
    assert c.step(1.0, ready=False) and c.state is ChildState.DOWN
    assert c.step(2.0, ready=True) and c.state is ChildState.UP
    assert len(spawned) == 1 and c.last_restart_to_serving_s is None


def test_exit_records_say_how_the_process_ended() -> None:
    assert ExitRecord(1, 3, 0.0).how == "exit code 3"
    assert ExitRecord(1, -9, 0.0).how == "signal SIGKILL"
    assert ExitRecord(1, -15, 0.0).as_dict()["how"] == "signal SIGTERM"


def test_bad_backoff_values_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="--restart-backoff-s: must be > 0"):
        RestartPolicy(initial_s=0)
    with pytest.raises(ConfigError, match="--restart-backoff-max-s: must be >="):
        RestartPolicy(initial_s=5, max_s=1)


def test_the_supervisor_records_changes_and_outlives_a_failing_look(tmp_path: Path) -> None:
    c, spawned = child(tmp_path)
    changes: list[str] = []

    async def ready(c: Child) -> bool:
        raise RuntimeError("probe broke")

    async def scenario() -> None:
        supervisor = Supervisor([c], ready, lambda: changes.append(c.state.value))
        await supervisor.tick()  # the look fails: logged, nothing changes
        spawned[0].returncode = -9
        await supervisor.tick()  # dead: no readiness asked

    asyncio.run(scenario())
    assert changes == ["down"]
