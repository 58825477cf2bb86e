"""The supervisor's decisions, step by step, with stand-in processes and the proxy's Engine."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import httpx
import pytest

from fabric.errors import ConfigError
from fabric.launch.supervisor import (
    GROUP_GONE_TIMEOUT_S,
    Child,
    ChildState,
    ExitRecord,
    RestartPolicy,
    Supervisor,
)
from fabric.router.engines import Engine

PIDS = itertools.count(1000)


class StandIn:
    """What the supervisor uses of a ManagedProcess; ``left`` stands for the
    processes of its group that outlive it (emptied by the test: they died)."""

    def __init__(self, log_path: Path) -> None:
        self.pid = next(PIDS)
        self.log_path = log_path
        self.returncode: int | None = None
        self.argv = ["stand-in"]
        self.left: list[int] = []
        self.kills = 0
        self.waited: list[float] = []

    def alive(self) -> bool:
        return self.returncode is None

    def log_tail(self) -> str:
        return "last words"

    def stop(self, timeout: float = 0) -> int | None:
        if self.returncode is None:
            self.returncode = -15
        self.kill_group()
        return self.returncode

    def group_pids(self) -> list[int]:
        return ([self.pid] if self.alive() else []) + self.left

    def kill_group(self) -> list[int]:
        pids = self.group_pids()
        if pids:
            self.kills += 1
        return pids

    def wait_group_gone(self, timeout: float) -> bool:
        self.waited.append(timeout)
        return not self.left


def child(tmp_path: Path, policy: RestartPolicy | None = None) -> tuple[Child, list[StandIn]]:
    spawned: list[StandIn] = []

    def spawn() -> StandIn:
        spawned.append(StandIn(tmp_path / "e.log"))
        return spawned[-1]

    c = Child("decode-0", spawn, policy or RestartPolicy(), drain_file=tmp_path / "drain")  # type: ignore[arg-type]
    c.engine = Engine("decode-0", "decode", "http://127.0.0.1:1", "tcp://127.0.0.1:2")
    c.start(0.0)
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
    assert c.last_restart_boot_s == 0.5  # from the restart's spawn at 1.1
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


def test_what_an_exited_process_left_in_its_group_is_killed_before_the_restart(
    tmp_path: Path,
) -> None:
    c, spawned = child(tmp_path)
    spawned[0].left = [4242]  # its EngineCore, say, holding the kv_port
    spawned[0].returncode = -9

    assert c.step(0.1, ready=False)
    assert c.engine is not None and not c.engine.healthy  # marked down at once
    assert spawned[0].kills == 1
    assert not c.step(1.1, ready=False)  # backoff over, the group is still there
    assert not c.step(5.0, ready=False)
    assert len(spawned) == 1
    spawned[0].left = []  # the kernel finished it
    assert c.step(5.1, ready=False)
    assert len(spawned) == 2 and c.state is ChildState.STARTING


def test_a_group_that_will_not_die_delays_the_restart_only_so_long(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c, spawned = child(tmp_path)
    spawned[0].left = [4242]
    spawned[0].returncode = -9
    c.step(0.1, ready=False)

    assert not c.step(0.1 + GROUP_GONE_TIMEOUT_S - 0.1, ready=False)
    assert c.step(0.1 + GROUP_GONE_TIMEOUT_S, ready=False)
    assert len(spawned) == 2
    assert "still run" in caplog.text and "4242" in caplog.text
    c.stop(1.0)  # fabric up's shutdown: the stuck group is killed once more, and waited for
    assert spawned[0].kills >= 3 and spawned[0].waited


def test_a_drained_engine_that_stops_leaves_nothing_in_its_group(tmp_path: Path) -> None:
    c, spawned = child(tmp_path)
    (tmp_path / "drain").write_text("{}")
    c.step(0.1, ready=True)
    spawned[0].left = [4343]
    spawned[0].returncode = 0
    c.step(0.2, ready=False)

    assert c.state is ChildState.STOPPED and spawned[0].kills == 1


def test_first_start_s_runs_from_the_first_spawn_to_the_first_serving(tmp_path: Path) -> None:
    spawned: list[StandIn] = []

    def spawn() -> StandIn:
        spawned.append(StandIn(tmp_path / "e.log"))
        return spawned[-1]

    c = Child("prefill-0", spawn, RestartPolicy())  # type: ignore[arg-type]
    c.start(10.0)
    assert c.as_dict()["first_start_s"] is None
    c.serving(12.5)
    spawned[0].returncode = -9
    c.step(20.0, ready=False)
    c.step(21.0, ready=False)  # restarted
    c.step(22.0, ready=True)

    assert c.as_dict()["first_start_s"] == 2.5
    assert c.as_dict()["last_restart_to_serving_s"] == 2.0
    assert c.as_dict()["last_restart_boot_s"] == 1.0


def test_the_probes_of_all_children_run_at_once(tmp_path: Path) -> None:
    children = [child(tmp_path)[0] for _ in range(3)]
    running = 0
    most = 0

    async def ready(c: Child) -> bool:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            # NOTE: answers once all are asked; one after another, the first gives up.
            for _ in range(200):
                if most == len(children):
                    return True
                await asyncio.sleep(0.01)
            return False
        finally:
            running -= 1

    asyncio.run(Supervisor(children, ready, lambda: None).tick())
    assert most == len(children)


def test_an_exit_is_marked_down_while_another_probe_hangs(tmp_path: Path) -> None:
    hung, _ = child(tmp_path)
    exits, spawned = child(tmp_path)
    asked = asyncio.Event()

    async def ready(c: Child) -> bool:
        if c is hung:
            asked.set()
            await asyncio.sleep(3600)  # NOTE: a probe that never answers
        return True

    async def scenario() -> bool:
        task = asyncio.create_task(Supervisor([hung, exits], ready, lambda: None).run())
        await asyncio.wait_for(asked.wait(), 30)
        spawned[0].returncode = -9
        assert exits.engine is not None
        for _ in range(300):  # a hang guard, not a bound
            if not exits.engine.healthy:
                break
            await asyncio.sleep(0.1)
        task.cancel()
        return not exits.engine.healthy

    assert asyncio.run(scenario())
    assert exits.state is ChildState.DOWN


def test_a_probe_answered_by_a_process_that_exited_meanwhile_is_not_taken(
    tmp_path: Path,
) -> None:
    c, spawned = child(tmp_path)

    async def ready(asked: Child) -> bool:
        spawned[0].returncode = -9  # it dies while its probe is out...
        c.step(1.0, ready=False)
        c.step(2.1, ready=False)  # ...and its successor starts
        return True

    asyncio.run(Supervisor([c], ready, lambda: None).probe())
    assert len(spawned) == 2
    assert c.state is ChildState.STARTING  # not up on the answer of the one before


def test_the_self_probe_does_not_mark_up_the_successor_of_the_process_it_asked(
    tmp_path: Path,
) -> None:
    from fabric.launch.running import _readiness

    c, spawned = child(tmp_path)
    assert c.engine is not None
    c.engine.mark_down("process exited")

    async def answer(request: httpx.Request) -> httpx.Response:
        spawned[0].returncode = -9  # the process asked exits, another one starts
        c.step(1.0, ready=False)
        c.step(2.1, ready=False)
        return httpx.Response(200)

    async def scenario() -> bool:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return bool(await _readiness(client, True)(c))

    assert not asyncio.run(scenario())
    assert len(spawned) == 2 and not c.engine.healthy


def _restarted(tmp_path: Path) -> tuple[Child, list[StandIn]]:
    """A child whose process exited and was restarted (``starting``)."""
    c, spawned = child(tmp_path)
    spawned[0].returncode = -9
    c.step(1.0, ready=False)
    c.step(2.1, ready=False)
    assert len(spawned) == 2 and c.state is ChildState.STARTING
    return c, spawned


def test_a_restart_is_probed_at_each_tick_not_at_the_proxys_next_round(tmp_path: Path) -> None:
    """With a proxy that probes every health_interval_s, a restarted engine
    is asked at once with the proxy's own probe, and serves when it answers."""
    from fabric.launch.running import _readiness

    c, _ = _restarted(tmp_path)
    assert c.engine is not None
    asked: list[Engine] = []

    async def probe_one(engine: Engine) -> bool:
        asked.append(engine)
        engine.mark_up()
        return True

    async def scenario() -> None:
        async with httpx.AsyncClient() as client:
            await Supervisor([c], _readiness(client, False, probe_one), lambda: None).probe()

    asyncio.run(scenario())
    assert asked == [c.engine] and c.engine.healthy
    assert c.state is ChildState.UP and c.last_restart_to_serving_s is not None


def test_an_engine_that_is_up_or_down_without_a_restart_is_left_to_the_proxy(
    tmp_path: Path,
) -> None:
    """Only a (re)start is probed by the supervisor; an engine the proxy's
    probe took out of rotation (alive, not answering) waits for its next round."""
    from fabric.launch.running import _readiness

    c, _ = child(tmp_path)
    assert c.engine is not None
    c.engine.mark_down("/health: ReadTimeout")
    asked: list[Engine] = []

    async def probe_one(engine: Engine) -> bool:
        asked.append(engine)
        return True

    async def scenario() -> bool:
        async with httpx.AsyncClient() as client:
            return bool(await _readiness(client, False, probe_one)(c))

    assert not asyncio.run(scenario())
    assert asked == []


def test_a_restart_that_exits_while_probed_is_not_marked_up(tmp_path: Path) -> None:
    from fabric.launch.running import _readiness

    c, spawned = _restarted(tmp_path)
    assert c.engine is not None

    async def probe_one(engine: Engine) -> bool:
        spawned[1].returncode = -9  # it dies while its probe is out (the answer came first)
        engine.mark_up()
        return True

    async def scenario() -> bool:
        async with httpx.AsyncClient() as client:
            return bool(await _readiness(client, False, probe_one)(c))

    assert not asyncio.run(scenario())
    assert not c.engine.healthy
