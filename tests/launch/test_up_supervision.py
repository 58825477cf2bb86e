"""``fabric up`` keeps its processes running and drains on SIGTERM (fake engines)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.launch._up import (
    DRAIN_FAKE,
    FAKE,
    UpRun,
    broken_when,
    holding,
    is_running,
    stream_lines,
)

SLOW = [*FAKE, "--token-delay-s", "0.1"]
SLOW_DRAIN = [*DRAIN_FAKE, "--token-delay-s", "0.1"]


@pytest.fixture
def runs() -> Iterator[list[UpRun]]:
    started: list[UpRun] = []
    yield started
    for run in started:
        run.kill_all()


def test_killed_engine_is_restarted_on_its_port_and_serves_again(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    run = UpRun(tmp_path, FAKE, FAKE)
    runs.append(run)
    url = run.wait_serving()
    before = run.engine_state("prefill-0")

    os.kill(before["pid"], signal.SIGKILL)
    after = run.wait_state("prefill-0", lambda e: e["restarts"] == 1 and e["state"] == "up")
    engines = httpx.get(f"{url}/fabric/status", timeout=10).json()["engines"]
    response = run.complete()
    status = run.stop()

    assert before["state"] == "up" and before["restarts"] == 0
    assert before["first_start_s"] > 0 and after["first_start_s"] == before["first_start_s"]
    assert after["pid"] != before["pid"] and after["url"] == before["url"]
    assert after["last_exit"]["how"] == "signal SIGKILL"
    assert after["last_exit"]["pid"] == before["pid"]
    assert after["last_restart_to_serving_s"] > 0
    # NOTE: the spawn comes after the exit and the backoff (1 s here)
    assert 0 < after["last_restart_boot_s"] < after["last_restart_to_serving_s"] - 0.5
    assert next(e for e in engines if e["name"] == "prefill-0")["healthy"] is True
    stderr = "".join(run.stderr)
    assert f"prefill-0 (pid {before['pid']}) exited with signal SIGKILL; restart 1" in stderr
    assert f"restarted prefill-0 (pid {after['pid']}), restart 1" in stderr
    assert "prefill-0 is serving again" in stderr
    assert response.status_code == 200, response.text
    assert status == 0
    assert not run.leftovers()


def test_a_leader_killed_alone_takes_its_group_along_and_comes_back_on_its_ports(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    # NOTE: as vLLM's API server killed alone (OOM, kill -9) leaves its
    # EngineCore holding the kv_port: a restart would fail to bind, forever.
    holders = tmp_path / "holders"
    run = UpRun(tmp_path, FAKE, holding(holders, FAKE), args=["--restart-backoff-s", "0.2"])
    runs.append(run)
    run.wait_serving()
    before = run.engine_state("decode-0")
    first_holder = int(holders.read_text().split()[0])

    os.kill(before["pid"], signal.SIGKILL)  # the leader only
    after = run.wait_state("decode-0", lambda e: e["restarts"] >= 1 and e["state"] == "up")
    response = run.complete()
    pids = [int(pid) for pid in holders.read_text().split()]
    old_holder_ran = is_running(first_holder)
    status = run.stop()

    assert not old_holder_ran
    assert after["restarts"] == 1 and after["last_exit"]["how"] == "signal SIGKILL"
    assert pids == [first_holder, pids[1]] and pids[1] != first_holder  # bound again
    assert response.status_code == 200, response.text
    assert "left 1 processes in its group" in "".join(run.stderr)
    assert status == 0
    assert not run.leftovers() and not any(is_running(pid) for pid in pids)


def test_a_drained_engine_leaves_nothing_of_its_group_running(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    holders = tmp_path / "holders"
    run = UpRun(tmp_path, FAKE, holding(holders, DRAIN_FAKE))
    runs.append(run)
    run.wait_serving()
    leader = run.engine_state("decode-0")["pid"]
    holder = int(holders.read_text().split()[0])

    os.kill(leader, signal.SIGTERM)  # drains, exits, stays stopped
    run.wait_state("decode-0", lambda e: e["state"] == "stopped")
    deadline = time.monotonic() + 30
    while is_running(holder) and time.monotonic() < deadline:  # a hang guard
        time.sleep(0.1)
    holder_ran = is_running(holder)
    status = run.stop()

    assert not holder_ran  # killed while fabric up still runs, not only at its exit
    assert status == 0
    assert not run.leftovers()


def test_sighup_drains_and_stops_like_sigterm(tmp_path: Path, runs: list[UpRun]) -> None:
    run = UpRun(tmp_path, FAKE, FAKE)
    runs.append(run)
    run.wait_serving()

    status = run.stop(signal.SIGHUP)

    assert status == 0
    assert "fabric up: drained" in "".join(run.lines.queue)
    assert not run.leftovers()


def test_crash_looping_engine_backs_off_and_shows_down(tmp_path: Path, runs: list[UpRun]) -> None:
    marker = tmp_path / "broken"
    run = UpRun(tmp_path, FAKE, broken_when(str(marker), FAKE), args=["--restart-backoff-s", "0.5"])
    runs.append(run)
    url = run.wait_serving()
    marker.touch()
    os.kill(run.engine_state("decode-0")["pid"], signal.SIGKILL)
    run.wait_state("decode-0", lambda e: e["restarts"] >= 1)

    time.sleep(6.0)  # backoff 0.5, 1, 2, 4 s: about 3 more restarts, never dozens
    entry = run.engine_state("decode-0")
    engines = httpx.get(f"{url}/fabric/status", timeout=10).json()["engines"]

    assert 2 <= entry["restarts"] <= 5, entry
    assert entry["state"] in ("down", "starting")
    assert entry["last_exit"]["how"] == "exit code 3"
    assert next(e for e in engines if e["name"] == "decode-0")["healthy"] is False
    assert "broken" in (run.workdir / "logs" / "decode-0.log").read_text()
    from fabric.launch.status import fetch_status, read_up_state, render_plain, with_up_state

    shown = render_plain(with_up_state(fetch_status(url), read_up_state(run.workdir), url))
    row = next(line for line in shown.splitlines() if line.startswith("decode-0")).split()
    assert row[2] == "no" and row[3] in ("down", "starting") and int(row[4]) >= 2
    assert run.stop() == 0
    assert not run.leftovers()


def test_killed_store_comes_back_and_its_endpoint_file_follows(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    run = UpRun(tmp_path, FAKE, FAKE, store={"mem_gib": 0.01})
    runs.append(run)
    url = run.wait_serving()
    endpoint_file = run.workdir / "run" / "store.endpoint"
    before = run.state()["store"]
    old_endpoint = endpoint_file.read_text()

    os.kill(before["pid"], signal.SIGKILL)
    after = run.wait_state("store", lambda e: e["restarts"] == 1 and e["state"] == "up")
    new_endpoint = endpoint_file.read_text()
    shared = httpx.get(f"{url}/fabric/status", timeout=10).json()["shared_store"]
    status = run.stop()

    assert after["pid"] != before["pid"] and after["last_exit"]["how"] == "signal SIGKILL"
    assert new_endpoint != old_endpoint  # port 0: a new free port, found through the file
    assert shared["endpoint"] == new_endpoint and "error" not in shared
    assert status == 0
    assert not run.leftovers()


def test_sigterm_lets_a_running_stream_finish_refuses_new_requests_then_stops(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    run = UpRun(tmp_path, FAKE, SLOW)
    runs.append(run)
    url = run.wait_serving()
    first = threading.Event()
    body = {"model": "fake", "prompt": "drain me", "max_tokens": 30, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_lines, url, body, first)
        assert first.wait(30), "the stream never started"

        run.process.send_signal(signal.SIGTERM)
        run.wait_line(r"draining: 1 requests in flight")
        refused = run.complete()
        lines = stream.result(timeout=60)
    status = run.process.wait(60)

    assert refused.status_code == 503
    assert "draining" in refused.json()["error"]["message"]
    assert lines[-1] == "data: [DONE]" and len(lines) == 31  # 30 tokens, nothing cut
    assert status == 0
    assert "fabric up: drained" in "".join(run.lines.queue)
    assert not run.leftovers()
    assert not (run.workdir / "run" / "up.json").exists()


def test_the_proxy_drain_is_bounded_by_the_drain_timeout(tmp_path: Path, runs: list[UpRun]) -> None:
    run = UpRun(tmp_path, FAKE, SLOW, args=["--drain-timeout-s", "1"])
    runs.append(run)
    url = run.wait_serving()
    first = threading.Event()
    body = {"model": "fake", "prompt": "long", "max_tokens": 600, "stream": True}  # 60 s
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_lines_or_cut, url, body, first)
        assert first.wait(30), "the stream never started"
        started = time.monotonic()
        run.process.send_signal(signal.SIGTERM)
        status = run.process.wait(60)
        waited = time.monotonic() - started
        lines = stream.result(timeout=30)

    assert waited >= 1.0  # it waited for the stream, up to the drain timeout
    assert status == 0
    assert len(lines) < 601  # then cut it
    assert "drain timeout: 1 requests still running are cut" in "".join(run.lines.queue)
    assert not run.leftovers()


def test_sigterm_to_one_engine_drains_it_and_it_stays_stopped_until_sigusr1(
    tmp_path: Path, runs: list[UpRun]
) -> None:
    decoders = [{"command": SLOW_DRAIN}, {"command": SLOW}]
    run = UpRun(tmp_path, FAKE, decoders, proxy={"decode_policy": "least_outstanding"})
    runs.append(run)
    url = run.wait_serving()
    d0 = run.engine_state("decode-0")
    events = [threading.Event(), threading.Event()]
    body = {"model": "fake", "prompt": "drain me", "max_tokens": 30, "stream": True}
    with ThreadPoolExecutor(2) as pool:
        streams = []
        for event in events:  # least outstanding: the first to decode-0, the next to decode-1
            streams.append(pool.submit(stream_lines, url, body, event))
            assert event.wait(30), "the stream never started"
        on_d0 = _seen(d0["url"])
        assert on_d0 >= 1

        os.kill(d0["pid"], signal.SIGTERM)
        run.wait_state("decode-0", lambda e: e["state"] == "draining")
        later = [run.complete(f"later {i}") for i in range(3)]
        assert _seen(d0["url"]) == on_d0  # nothing new reached decode-0
        results = [s.result(timeout=60) for s in streams]
    stopped = run.wait_state("decode-0", lambda e: e["state"] == "stopped")
    time.sleep(2.5)  # more than the first restart backoff (1 s)
    still = run.engine_state("decode-0")
    os.kill(run.process.pid, signal.SIGUSR1)
    back = run.wait_state("decode-0", lambda e: e["state"] == "up")
    status = run.stop()

    assert [r.status_code for r in later] == [200, 200, 200]
    assert all(lines[-1] == "data: [DONE]" and len(lines) == 31 for lines in results)
    assert stopped["pid"] is None and stopped["restarts"] == 0
    assert still["state"] == "stopped" and still["restarts"] == 0
    assert stopped["last_exit"]["pid"] == d0["pid"]
    assert back["restarts"] == 1 and back["pid"] != d0["pid"]
    assert status == 0
    assert not run.leftovers()


def _seen(engine_url: str) -> int:
    """How many client requests a fake engine saw (the proxy's canaries left out)."""
    seen = httpx.get(f"{engine_url}/fake/requests", timeout=10).json()
    return sum(not (r["request_id"] or "").startswith("fabric-canary") for r in seen)


def _lines_or_cut(url: str, body: dict[str, object], first: threading.Event) -> list[str]:
    lines: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                first.set()
    except httpx.HTTPError:
        pass
    return [line for line in lines if line.startswith("data: ")]
