"""1P1D with fabric's FabricConnector vs vLLM's own NixlConnector vs one colocated engine.

    python benchmarks/pd_vs_nixl.py [--quick] [--setups fabric,nixl,colocated]

Real vLLM CPU engines on the KV-heavy tiny Llama (Llama-3-8B KV geometry,
128 KiB of KV per token), one setup at a time, every process on 127.0.0.1
with free ports and stopped by process group (also on error and Ctrl-C):

    fabric     P (FabricConnector, core 0) + D (FabricConnector, core 1)
               + the fabric proxy (``fabric proxy``, a subprocess)
    nixl       P (NixlConnector, kv_buffer_device cpu, core 0) + D (core 1)
               + fabric.bench.nixl_proxy (vLLM's documented NixlConnector flow)
    colocated  one engine without a connector (core 0)

Prompts are token-id lists of exactly 1,024 and 4,096 tokens (random ids,
seeded; the same prompts in every setup, a fresh prompt for every request so
nothing hits a prefix cache). Greedy, ``ignore_eos``, ``max_tokens`` 32,
streamed. Requests go one at a time.

``--rounds R`` (default 2) runs the setups R times in turn (fabric, nixl,
colocated, fabric, ...), each time with fresh engines, a warm-up and its
share of the requests, so a busy spell on the shared machine does not land
on one setup only.

Two phases per setup and prompt length, after one warm-up request per length:

- ``client`` (the headline; ``--requests``, default 5): the benchmark makes
  the two PD calls itself, exactly as each stack's proxy would (fabric's
  bodies from ``fabric.router.requests``, NIXL's from
  ``fabric.bench.nixl_proxy``): P with ``max_tokens`` 1, then D, streamed.
  The colocated engine gets the request directly. No proxy in the path for
  any setup, so the same client code times both connectors.
- ``proxy`` (``--proxied-requests``, default 2): the same kind of request
  through the stack's proxy, as a user sends it (no colocated row).

What is reported, per setup, length and phase (medians over requests):

- TTFT: request sent -> first output token; ITL: (last token - first
  token) / (tokens - 1) per request; E2E: request sent -> last token.
- out tok/s and req/s: output tokens and requests over the summed E2E
  (requests are sequential, so this is one client's throughput).
- P prefill: P's answer time (client phase).
- handoff raw: P's answer received -> D's first token. It holds D's HTTP and
  scheduling, the KV reaching D's cache (NIXL: the READ; fabric: the rest of
  the push plus the unpack), and D computing the last prompt token.
- D local-hit TTFT: right after, D gets the same prompt plus one token with
  no ``kv_transfer_params`` (3 times, one-token variants, median); its
  prefix cache holds the whole prompt (checked with D's
  ``vllm:prefix_cache_hits_total``), so D computes one token, as after a
  remote hit. This is D's own cost (HTTP, scheduling, one token).
- handoff = handoff raw - D local-hit TTFT, per request: prefill finished ->
  decoder has the KV, black-box and defined the same way for both
  connectors. The headline uses its median.
- connector xfer (white-box, D's own metrics, per request): NIXL's
  ``vllm:nixl_xfer_time_seconds`` (the READ); fabric's
  ``vllm:fabric_load_seconds`` when the connector exports it.
- CPU seconds (``/proc``, every process of the setup's engines): TTFT CPU
  (request sent -> first token), handoff CPU (P's answer -> D's first
  token). NIXL's include what its SCHED_IDLE pollers burn on idle cores.
- other cores: the machine is shared with other jobs, so wall times move
  with their load; CPU seconds do not. Each sample records how many cores
  processes outside the setup (not its engines, proxy or this client) kept
  busy during it, from ``/proc/stat``. Before each measured request the
  benchmark waits until that is at most ``--quiet-cores`` (0.3) over one
  second, for at most ``--quiet-wait-s`` (90 s; the wait is recorded).
- Every D metric delta named ``vllm:nixl_*``, ``vllm:fabric_*`` or
  ``vllm:*prefix_cache_*`` is saved per request; a request whose KV did not
  arrive (a connector failure counter moved) counts as a fallback.
- Output token ids of each PD request are compared with the colocated
  engine's for the same prompt.

Fairness: identical engine flags (``--enforce-eager``, bf16, block size 128,
``--max-num-batched-tokens`` 2048, ``--max-model-len`` 4608, seed 0, prefix
caching on), KV pool (``VLLM_CPU_KVCACHE_SPACE``), offline loopback env
(``UCX_NET_DEVICES=lo``), ``kv_load_failure_policy`` recompute, and
``VLLM_CPU_OMP_THREADS_BIND`` (P core 0, D core 1). With ``--threads tuned``
(default) every thread of every engine process (all setups) is pinned to its
engine's core after start and again after the warm-up (vLLM's NIXL worker
moves its thread to the last core, i.e. P's forward pass onto D's core), and
any engine thread that uses more than ``--spin-threshold`` of a core while
the engine is idle (a busy-polling progress thread: vLLM leaves NIXL's UCX
progress thread on; fabric keeps its off) is set to SCHED_IDLE. ``--threads
shipped`` skips that. Proxies and the client are not pinned. The JSON
records which threads were changed.

Output: a table, ``benchmarks/results/pd_vs_nixl-<date>-<time>.json``
(machine, settings, git state, every raw sample), and as the last stdout
line ``{"handoff_fabric_over_nixl_4k": .., "ttft_fabric_over_nixl_max": ..}``
(client phase; ``null`` where not measured or not meaningful). Progress goes
to stderr. Engine logs stay in ``--workdir`` (default: a new temp dir),
``logs/<setup>-r<round>-<engine>.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import yaml

from fabric.bench import nixl_proxy
from fabric.launch.process import (
    ManagedProcess,
    engine_env,
    free_port,
    vllm_serve_command,
    wait_http_ok,
)
from fabric.router import requests as fabric_requests

HOST = "127.0.0.1"
MODEL = "tiny"
PATH = "/v1/completions"
SETUPS = ("fabric", "nixl", "colocated")
PD_SETUPS = ("fabric", "nixl")
RESULTS_DIR = Path(__file__).resolve().with_name("results")
ROOT = Path(__file__).resolve().parents[1]
TOKEN_LOW, TOKEN_HIGH = 5, 500  # random ids, clear of the tiny tokenizer's specials
METRIC_PREFIXES = ("vllm:nixl_", "vllm:fabric_", "vllm:prefix_cache_", "vllm:external_prefix_")
XFER_METRICS = {"nixl": "vllm:nixl_xfer_time_seconds_sum", "fabric": "vllm:fabric_load_seconds_sum"}
LOCAL_HITS = "vllm:prefix_cache_hits_total"
REMOTE_HITS = "vllm:external_prefix_cache_hits_total"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LOCAL_REPEATS = 3  # D local-hit requests per measured request (median)


def say(message: str) -> None:
    """A progress line on stderr (stdout ends with the headline JSON)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    """Everything that shapes a run; saved with the results."""

    lengths: tuple[int, ...] = (1024, 4096)
    requests: int = 5
    proxied_requests: int = 2
    warmup: int = 1
    max_tokens: int = 32
    setups: tuple[str, ...] = SETUPS
    threads: str = "tuned"
    spin_threshold: float = 0.2
    kv_cache_gib: int = 1
    store_mib: int = 768
    chunk_tokens: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4608
    prefill_core: int = 0
    decode_core: int = 1
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 1800.0
    quiet_cores: float = 0.3
    quiet_wait_s: float = 90.0
    rounds: int = 2
    quick: bool = False


# ---------------------------------------------------------------- prompts and bodies


def prompt_ids(length: int, phase: str, index: int) -> list[int]:
    """A deterministic prompt of exactly ``length`` token ids, unique per (phase, index)."""
    rng = random.Random(f"pd_vs_nixl/{phase}/{length}/{index}")
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)]


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


# ---------------------------------------------------------------- pure arithmetic


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def itl_s(token_s: Sequence[float]) -> float | None:
    """Mean inter-token latency of one request from its token arrival times."""
    if len(token_s) < 2:
        return None
    return (token_s[-1] - token_s[0]) / (len(token_s) - 1)


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
    """Whether a connector failure counter moved (D recomputed instead of loading)."""
    return any(d > 0 for n, d in deltas.items() if "fail" in n or "expired" in n)


# ---------------------------------------------------------------- samples


@dataclass
class Sample:
    """One measured request (times in seconds)."""

    setup: str
    phase: str
    length: int
    index: int
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)
    prefill_s: float | None = None
    handoff_raw_s: float | None = None
    local_ttft_s: float | None = None
    local_hit_tokens: float | None = None
    handoff_s: float | None = None
    xfer_s: float | None = None
    prefill_cpu_s: float | None = None
    handoff_cpu_s: float | None = None
    ttft_cpu_s: float | None = None
    remote_tokens: float | None = None
    fallback: bool = False
    decode_metrics: dict[str, float] = field(default_factory=dict)
    load_avg_1m: float | None = None
    other_cores: float | None = None
    quiet_wait_s: float | None = None
    error: str | None = None


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

    ``on_first_token`` is called once, when the first token arrives.
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


def fill_from_stream(sample: Sample, stream: Stream, offset_s: float = 0.0) -> None:
    """TTFT, ITL, E2E and tokens of ``sample`` from D's stream started ``offset_s`` late."""
    sample.error = stream.error
    sample.token_ids, sample.output_tokens = stream.token_ids, len(stream.token_ids)
    sample.token_s = [round(offset_s + t, 6) for t in stream.token_s]
    sample.prompt_tokens = stream.prompt_tokens
    if sample.error is None and stream.prompt_tokens not in (None, sample.length):
        sample.error = f"the prompt had {stream.prompt_tokens} tokens, not {sample.length}"
    sample.itl_s = itl_s(stream.token_s)
    if stream.token_s:
        sample.ttft_s = offset_s + stream.token_s[0]
        sample.e2e_s = offset_s + stream.end_s


def load_avg() -> float | None:
    """The 1-minute load average (the machine is shared)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def process_cpu_s(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes (every thread, live or exited)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = _stat_fields(f"/proc/{pid}/stat")
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


@dataclass(frozen=True)
class CpuMark:
    """The machine's busy CPU seconds and this setup's own (engines, proxy, client) at a time."""

    wall_s: float
    busy_s: float
    ours_s: float


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy (user, nice, system, irq, softirq)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / CLOCK_TICKS


def other_cores(start: CpuMark, end: CpuMark) -> float:
    """Cores that processes outside this setup kept busy on average between two marks."""
    wall = end.wall_s - start.wall_s
    if wall <= 0:
        return 0.0
    return max(0.0, ((end.busy_s - start.busy_s) - (end.ours_s - start.ours_s)) / wall)


# ---------------------------------------------------------------- stacks


@dataclass
class Stack:
    """Where one setup answers, and how its two PD calls are built."""

    name: str
    decode_url: str
    prefill_url: str | None = None
    proxy_url: str | None = None
    prefill_body: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    decode_body: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    engine_pids: list[int] = field(default_factory=list)
    proxy_pid: int | None = None

    def cpu_s(self) -> float:
        """CPU seconds the setup's engine processes have used so far."""
        return process_cpu_s(self.engine_pids)

    def mark(self) -> CpuMark:
        """Now: the machine's busy CPU seconds and the setup's own (with proxy and client)."""
        own = os.times()
        proxy = process_cpu_s([self.proxy_pid] if self.proxy_pid else [])
        ours = self.cpu_s() + proxy + own.user + own.system
        return CpuMark(time.monotonic(), machine_busy_s(), ours)


def wait_quiet(target: Stack, settings: Settings) -> tuple[float, float]:
    """Wait (bounded) until other processes use at most ``quiet_cores``; (waited s, their cores)."""
    started = time.monotonic()
    while True:
        mark = target.mark()
        time.sleep(1.0)
        others = other_cores(mark, target.mark())
        waited = time.monotonic() - started
        if others <= settings.quiet_cores or waited >= settings.quiet_wait_s:
            return waited, others
        time.sleep(4.0)


def fabric_stack(prefill_url: str, decode_url: str, kv_port: int) -> Stack:
    """fabric: P pushes to D's control channel named in the prefill params."""
    endpoint = f"tcp://{HOST}:{kv_port}"
    return Stack(
        "fabric",
        decode_url,
        prefill_url,
        prefill_body=lambda body, rid: fabric_requests.prefill_body(body, rid, endpoint),
        decode_body=fabric_requests.decode_body,
    )


def nixl_stack(prefill_url: str, decode_url: str) -> Stack:
    """vLLM NixlConnector: D pulls from P with the params P returned."""
    return Stack(
        "nixl",
        decode_url,
        prefill_url,
        prefill_body=lambda body, rid: nixl_proxy.prefill_body(body),
        decode_body=nixl_proxy.decode_body,
    )


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """The engine's connector and prefix-cache metrics."""
    return parse_metrics(client.get(url + "/metrics").text)


def pd_sample(
    client: httpx.Client, stack: Stack, settings: Settings, phase: str, length: int, index: int
) -> Sample:
    """P then D from the client, then D's local-hit baseline; see the module docstring."""
    assert stack.prefill_url and stack.prefill_body and stack.decode_body
    sample = Sample(stack.name, phase, length, index, load_avg_1m=load_avg())
    prompt = prompt_ids(length, phase, index)
    body = generation_body(prompt, settings.max_tokens)
    rid = f"bench-{uuid4().hex}"
    headers = {"content-type": "application/json", "x-request-id": rid}
    prefill_content = dump(stack.prefill_body(body, rid))
    before = scrape(client, stack.decode_url)
    cpu_start = stack.cpu_s()
    started = time.perf_counter()
    answer = client.post(stack.prefill_url + PATH, content=prefill_content, headers=headers)
    sample.prefill_s = time.perf_counter() - started
    cpu_answer = stack.cpu_s()
    sample.prefill_cpu_s = cpu_answer - cpu_start
    params = answer.json().get("kv_transfer_params") if answer.status_code == 200 else None
    if not isinstance(params, dict):
        sample.error = f"prefill: HTTP {answer.status_code}, params {params!r}: {answer.text[:300]}"
        return sample
    first: list[float] = []
    stream = stream_completion(
        client,
        stack.decode_url + PATH,
        dump(stack.decode_body(body, params)),
        headers,
        on_first_token=lambda: first.append(stack.cpu_s()),
    )
    fill_from_stream(sample, stream, offset_s=stream.started - started)
    if sample.ttft_s is not None:
        sample.handoff_raw_s = sample.ttft_s - sample.prefill_s
    if first:
        sample.handoff_cpu_s, sample.ttft_cpu_s = first[0] - cpu_answer, first[0] - cpu_start
    after = scrape(client, stack.decode_url)
    _local_baseline(client, stack, sample, prompt)
    _white_box(sample, metric_deltas(before, after))
    return sample


def _local_baseline(client: httpx.Client, stack: Stack, sample: Sample, prompt: list[int]) -> None:
    """D's TTFT for the prompt plus one token, a full local prefix hit; median of a few."""
    ttfts = []
    for repeat in range(LOCAL_REPEATS):
        rng = random.Random(f"extra/{sample.length}/{sample.index}/{repeat}")
        content = dump(generation_body([*prompt, rng.randrange(TOKEN_LOW, TOKEN_HIGH)], 1))
        before = scrape(client, stack.decode_url)
        local = stream_completion(client, stack.decode_url + PATH, content)
        hits = metric_deltas(before, scrape(client, stack.decode_url)).get(LOCAL_HITS, 0.0)
        known = sample.local_hit_tokens
        sample.local_hit_tokens = hits if known is None else min(known, hits)
        # NOTE: only a full hit computes one token, as D does after a remote hit.
        if local.token_s and local.error is None and hits >= sample.length:
            ttfts.append(local.token_s[0])
    if len(ttfts) == LOCAL_REPEATS:
        sample.local_ttft_s = median(ttfts)
        sample.handoff_s = handoff_s(sample.handoff_raw_s, sample.local_ttft_s)


def _white_box(sample: Sample, deltas: dict[str, float]) -> None:
    sample.decode_metrics = deltas
    sample.xfer_s = deltas.get(XFER_METRICS.get(sample.setup, ""))
    sample.remote_tokens = deltas.get(REMOTE_HITS)
    sample.fallback = is_fallback(deltas)


def direct_sample(
    client: httpx.Client,
    url: str,
    stack: Stack,
    settings: Settings,
    phase: str,
    length: int,
    index: int,
) -> Sample:
    """One streamed request to ``url`` (the colocated engine, or the stack's proxy)."""
    sample = Sample(stack.name, phase, length, index, load_avg_1m=load_avg())
    body = generation_body(prompt_ids(length, phase, index), settings.max_tokens)
    headers = {"x-request-id": f"bench-{uuid4().hex}"}
    first: list[float] = []
    pd = stack.prefill_url is not None
    before = scrape(client, stack.decode_url) if pd else {}
    cpu_start = stack.cpu_s()
    stream = stream_completion(
        client, url + PATH, dump(body), headers, on_first_token=lambda: first.append(stack.cpu_s())
    )
    fill_from_stream(sample, stream)
    if first:
        sample.ttft_cpu_s = first[0] - cpu_start
    if pd:  # through a PD proxy: did D load the KV?
        _white_box(sample, metric_deltas(before, scrape(client, stack.decode_url)))
    return sample


# ---------------------------------------------------------------- engines and threads


@dataclass
class EngineSpec:
    """One engine of a setup."""

    name: str
    core: int
    kv_transfer_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Running:
    """A started engine."""

    spec: EngineSpec
    process: ManagedProcess
    url: str
    start_s: float = 0.0


def fabric_specs(settings: Settings, kv_port: int) -> list[EngineSpec]:
    """P and D with the FabricConnector (D's control channel on ``kv_port``)."""
    extra = {
        "chunk_tokens": settings.chunk_tokens,
        "store_mib": settings.store_mib,
        "transport": "nixl",
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
        EngineSpec("prefill", settings.prefill_core, config("kv_producer")),
        EngineSpec("decode", settings.decode_core, config("kv_consumer", kv_port=kv_port)),
    ]


def nixl_specs(settings: Settings) -> list[EngineSpec]:
    """P and D with vLLM's NixlConnector on CPU buffers, side channels on loopback."""

    def spec(name: str, core: int, role: str) -> EngineSpec:
        config = {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute",
        }
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        return EngineSpec(name, core, config, env)

    return [
        spec("prefill", settings.prefill_core, "kv_producer"),
        spec("decode", settings.decode_core, "kv_consumer"),
    ]


def start_engines(
    specs: list[EngineSpec],
    tag: str,
    model_dir: Path,
    workdir: Path,
    settings: Settings,
    processes: ExitStack,
) -> dict[str, Running]:
    """Start every engine at once (each stopped by ``processes``); return once all are healthy."""
    runs = {}
    for spec in specs:
        port = free_port()
        argv = vllm_serve_command(
            model_dir,
            port,
            kv_transfer_config=spec.kv_transfer_config,
            max_model_len=settings.max_model_len,
            served_model_name=MODEL,
            extra_args=["--max-num-batched-tokens", str(settings.max_num_batched_tokens)],
        )
        home = workdir / "engines" / f"{tag}-{spec.name}"
        env = engine_env(home, cpu_cores=str(spec.core), kv_cache_gib=settings.kv_cache_gib)
        log = workdir / "logs" / f"{tag}-{spec.name}.log"
        process = ManagedProcess(
            argv, log_path=log, env={**env, **spec.env}, cwd=home, name=spec.name
        )
        processes.callback(process.stop)
        runs[spec.name] = Running(spec, process, f"http://{HOST}:{port}")
    started = time.monotonic()
    for run in runs.values():
        wait_http_ok(run.url + "/health", settings.startup_timeout_s, run.process)
        run.start_s = time.monotonic() - started
        say(f"{tag}: {run.spec.name} healthy after {run.start_s:.0f} s ({run.process.log_path})")
    return runs


def group_pids(pgid: int) -> list[int]:
    """Every process in process group ``pgid`` (an engine and what it spawned)."""
    out = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.isdigit() and int(_stat_fields(f"/proc/{entry}/stat")[2]) == pgid:
                out.append(int(entry))
    return out


def group_threads(pgid: int) -> list[tuple[int, int]]:
    """(pid, tid) of every thread of every process in process group ``pgid``."""
    out = []
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError, ValueError):
            out += [(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
    return out


def _stat_fields(path: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` file after the command name."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def thread_ticks(pid: int, tid: int) -> int | None:
    """User + system clock ticks of one thread (None once it is gone)."""
    try:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def thread_name(pid: int, tid: int) -> str:
    """The thread's ``comm``."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def tune_threads(
    runs: dict[str, Running], threshold: float, window_s: float = 2.0
) -> dict[str, Any]:
    """Pin every engine thread to its engine's core; SCHED_IDLE for idle-time busy pollers."""
    threads = {}
    pinned = 0
    for run in runs.values():
        for pid, tid in group_threads(run.process.pid):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, {run.spec.core})
                pinned += 1
                threads[tid] = (run.spec.name, pid)
    before = {tid: thread_ticks(pid, tid) for tid, (_, pid) in threads.items()}
    time.sleep(window_s)
    per_s = CLOCK_TICKS * window_s
    idled = []
    for tid, (name, pid) in threads.items():
        start, end = before[tid], thread_ticks(pid, tid)
        if start is None or end is None or (end - start) / per_s <= threshold:
            continue
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            share = round((end - start) / per_s, 2)
            idled.append(
                {"engine": name, "tid": tid, "comm": thread_name(pid, tid), "share": share}
            )
    return {"pinned_threads": pinned, "sched_idle": idled}


def start_proxy(
    setup: str,
    tag: str,
    runs: dict[str, Running],
    kv_port: int | None,
    workdir: Path,
    settings: Settings,
    processes: ExitStack,
) -> tuple[str, int]:
    """Start the setup's proxy as a subprocess; its URL and pid once ``/health`` answers."""
    port = free_port()
    prefill, decode = runs["prefill"].url, runs["decode"].url
    timeout = settings.request_timeout_s
    if setup == "fabric":
        topology = {
            "workdir": str(workdir / "proxy"),
            "prefill": [{"url": prefill}],
            "decode": [{"url": decode, "kv_port": kv_port}],
            "proxy": {
                "host": HOST,
                "port": port,
                "prefill_timeout_s": timeout,
                "decode_timeout_s": timeout,
            },
        }
        path = workdir / f"{tag}-proxy.yaml"
        path.write_text(yaml.safe_dump(topology))
        argv = [sys.executable, "-m", "fabric.cli", "proxy", str(path)]
    else:
        argv = [
            sys.executable,
            "-m",
            "fabric.bench.nixl_proxy",
            "--host",
            HOST,
            "--port",
            str(port),
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--timeout-s",
            str(timeout),
        ]
    process = ManagedProcess(argv, log_path=workdir / "logs" / f"{tag}-proxy.log", name="proxy")
    processes.callback(process.stop)
    url = f"http://{HOST}:{port}"
    wait_http_ok(url + "/health", 60.0, process)
    return url, process.pid


# ---------------------------------------------------------------- one setup


def round_indices(count: int, rounds: int, round_: int) -> range:
    """Request indices of round ``round_`` when ``count`` requests are split over ``rounds``."""
    return range(round_ * count // rounds, (round_ + 1) * count // rounds)


def run_setup(
    setup: str,
    round_: int,
    settings: Settings,
    model_dir: Path,
    workdir: Path,
    client: httpx.Client,
) -> dict[str, Any]:
    """Start a setup, warm it up, measure one round of requests, stop it (also on error)."""
    from fabric.router.serve import signals_ignored

    record: dict[str, Any] = {"setup": setup, "round": round_, "tuning": [], "samples": []}
    processes = ExitStack()
    try:
        runs, target = _start_setup(setup, round_, settings, model_dir, workdir, processes)
        record["engines"] = {name: _engine_record(run) for name, run in runs.items()}
        _measure_setup(record, runs, target, settings, client)
    finally:
        with signals_ignored():
            say(f"{setup}: stopping")
            processes.close()
    return record


def _start_setup(
    setup: str,
    round_: int,
    settings: Settings,
    model_dir: Path,
    workdir: Path,
    processes: ExitStack,
) -> tuple[dict[str, Running], Stack]:
    tag = f"{setup}-r{round_}"
    if setup == "colocated":
        specs = [EngineSpec("engine", settings.prefill_core)]
        runs = start_engines(specs, tag, model_dir, workdir, settings, processes)
        return runs, Stack(setup, runs["engine"].url)
    kv_port = free_port() if setup == "fabric" else None
    specs = fabric_specs(settings, kv_port) if kv_port else nixl_specs(settings)
    runs = start_engines(specs, tag, model_dir, workdir, settings, processes)
    p, d = runs["prefill"].url, runs["decode"].url
    target = fabric_stack(p, d, kv_port) if kv_port else nixl_stack(p, d)
    target.proxy_url, target.proxy_pid = start_proxy(
        setup, tag, runs, kv_port, workdir, settings, processes
    )
    return runs, target


def _engine_record(run: Running) -> dict[str, Any]:
    return {
        "start_s": round(run.start_s, 1),
        "core": run.spec.core,
        "kv_transfer_config": run.spec.kv_transfer_config,
        "log": str(run.process.log_path),
    }


def _measure_setup(
    record: dict[str, Any],
    runs: dict[str, Running],
    target: Stack,
    settings: Settings,
    client: httpx.Client,
) -> None:
    tuned = settings.threads == "tuned"
    if tuned:
        record["tuning"].append(tune_threads(runs, settings.spin_threshold))
    target.engine_pids = [pid for run in runs.values() for pid in group_pids(run.process.pid)]
    measure = _measure_fn(client, target, settings)
    round_, rounds = record["round"], settings.rounds
    for length in settings.lengths:
        for i in range(settings.warmup):
            _log(record, measure("warmup", length, round_ * settings.warmup + i))
    if tuned:
        time.sleep(1.0)
        # NOTE: again after the first requests: threads they started are pinned too.
        record["tuning"].append(tune_threads(runs, settings.spin_threshold))
    for length in settings.lengths:
        for i in round_indices(settings.requests, rounds, round_):
            _log(record, measure("client", length, i))
        if target.proxy_url is not None:
            for i in round_indices(settings.proxied_requests, rounds, round_):
                _log(record, measure("proxy", length, i))


def _measure_fn(
    client: httpx.Client, target: Stack, settings: Settings
) -> Callable[[str, int, int], Sample]:
    def measure(phase: str, length: int, index: int) -> Sample:
        waited = None
        if phase != "warmup" and settings.quiet_wait_s > 0:
            waited, _ = wait_quiet(target, settings)
        start = target.mark()
        try:
            if target.prefill_url is None or phase == "proxy":
                url = target.proxy_url if phase == "proxy" else target.decode_url
                assert url is not None
                sample = direct_sample(client, url, target, settings, phase, length, index)
            else:
                sample = pd_sample(client, target, settings, phase, length, index)
        except (httpx.HTTPError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            sample = Sample(target.name, phase, length, index, error=error)
        sample.other_cores, sample.quiet_wait_s = other_cores(start, target.mark()), waited
        return sample

    return measure


def _log(record: dict[str, Any], sample: Sample) -> None:
    record["samples"].append(asdict(sample))
    parts = [f"{sample.setup} {sample.phase} {sample.length} #{sample.index}:"]
    for label, value in (
        ("TTFT", sample.ttft_s),
        ("prefill", sample.prefill_s),
        ("handoff raw", sample.handoff_raw_s),
        ("local", sample.local_ttft_s),
        ("xfer", sample.xfer_s),
        ("ITL", sample.itl_s),
    ):
        if value is not None:
            parts.append(f"{label} {value * 1000:.0f} ms")
    if sample.other_cores is not None:
        parts.append(f"others {sample.other_cores:.2f} cores")
    if sample.error or sample.fallback:
        parts.append(f"ERROR {sample.error}" if sample.error else "FALLBACK")
    say(" ".join(parts))


# ---------------------------------------------------------------- summaries


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (setup, length, phase) of measured samples: medians and throughput."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for s in samples:
        if s["phase"] != "warmup":
            groups.setdefault((s["setup"], s["length"], s["phase"]), []).append(s)
    return [_row(key, rows) for key, rows in groups.items()]


MEDIANS = ("ttft_s", "itl_s", "e2e_s", "prefill_s", "handoff_raw_s", "local_ttft_s", "handoff_s",
           "xfer_s", "remote_tokens", "prefill_cpu_s", "handoff_cpu_s", "ttft_cpu_s",
           "load_avg_1m", "other_cores", "quiet_wait_s")  # fmt: skip


def _row(key: tuple[str, int, str], samples: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [s for s in samples if s["error"] is None and s["ttft_s"] is not None]
    e2e = sum(s["e2e_s"] for s in ok)
    row: dict[str, Any] = {"setup": key[0], "length": key[1], "phase": key[2]}
    row.update(n=len(samples), errors=len(samples) - len(ok))
    row["fallbacks"] = sum(1 for s in samples if s["fallback"])
    for name in MEDIANS:
        row[name] = median(s[name] for s in ok)
    row["handoff_n"] = sum(1 for s in ok if s["handoff_s"] is not None)
    row["out_tok_per_s"] = sum(s["output_tokens"] for s in ok) / e2e if e2e else None
    row["req_per_s"] = len(ok) / e2e if e2e else None
    return row


def find_row(rows: list[dict[str, Any]], setup: str, length: int, phase: str) -> dict[str, Any]:
    """The summary row of (setup, length, phase), or an empty dict."""
    for row in rows:
        if (row["setup"], row["length"], row["phase"]) == (setup, length, phase):
            return row
    return {}


def headline(rows: list[dict[str, Any]], lengths: Sequence[int]) -> dict[str, float | None]:
    """fabric / NIXL: the 4k handoff and the worst TTFT ratio (client phase)."""
    at_4k = [find_row(rows, setup, 4096, "client").get("handoff_s") for setup in ("fabric", "nixl")]
    ttft = [
        ratio(
            find_row(rows, "fabric", n, "client").get("ttft_s"),
            find_row(rows, "nixl", n, "client").get("ttft_s"),
        )
        for n in lengths
    ]
    present = [r for r in ttft if r is not None]
    return {
        "handoff_fabric_over_nixl_4k": _round(ratio(*at_4k), 3),
        "ttft_fabric_over_nixl_max": _round(max(present), 3) if present else None,
    }


# name -> (metric, setup over setup, phase)
RATIOS = {
    "handoff_fabric_over_nixl": ("handoff_s", "fabric", "nixl", "client"),
    "handoff_raw_fabric_over_nixl": ("handoff_raw_s", "fabric", "nixl", "client"),
    "ttft_fabric_over_nixl": ("ttft_s", "fabric", "nixl", "client"),
    "ttft_fabric_over_nixl_proxied": ("ttft_s", "fabric", "nixl", "proxy"),
    "itl_fabric_over_nixl": ("itl_s", "fabric", "nixl", "client"),
    "prefill_fabric_over_nixl": ("prefill_s", "fabric", "nixl", "client"),
    "ttft_fabric_over_colocated": ("ttft_s", "fabric", "colocated", "client"),
    "ttft_nixl_over_colocated": ("ttft_s", "nixl", "colocated", "client"),
}


def ratios(rows: list[dict[str, Any]], lengths: Sequence[int]) -> dict[str, Any]:
    """Every ratio of ``RATIOS``, per prompt length."""
    return {
        str(n): {
            name: _round(ratio(find_row(rows, a, n, phase).get(metric),
                               find_row(rows, b, n, phase).get(metric)), 3)
            for name, (metric, a, b, phase) in RATIOS.items()
        }
        for n in lengths
    }  # fmt: skip


def token_matches(samples: list[dict[str, Any]]) -> dict[str, str]:
    """Per PD setup: client-phase requests whose output ids equal the colocated engine's."""
    want = {
        (s["length"], s["index"]): s["token_ids"]
        for s in samples
        if s["setup"] == "colocated" and s["phase"] == "client" and s["token_ids"]
    }
    out = {}
    for setup in PD_SETUPS:
        mine = [s for s in samples if s["setup"] == setup and s["phase"] == "client"]
        compared = [s for s in mine if (s["length"], s["index"]) in want]
        same = sum(1 for s in compared if s["token_ids"] == want[s["length"], s["index"]])
        if compared:
            out[setup] = f"{same}/{len(compared)}"
    return out


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1000:,.0f}"


def _num(digits: int) -> Callable[[float | None], str]:
    return lambda value: "" if value is None else f"{value:.{digits}f}"


# title -> (summary key, format)
COLUMNS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "setup": ("setup", str), "prompt": ("length", str), "phase": ("phase", str), "n": ("n", str),
    "TTFT ms": ("ttft_s", _ms), "ITL ms": ("itl_s", _ms), "out tok/s": ("out_tok_per_s", _num(2)),
    "req/s": ("req_per_s", _num(3)), "P prefill ms": ("prefill_s", _ms),
    "handoff raw ms": ("handoff_raw_s", _ms), "D local-hit ms": ("local_ttft_s", _ms),
    "handoff ms": ("handoff_s", _ms), "connector xfer ms": ("xfer_s", _ms),
    "TTFT CPU s": ("ttft_cpu_s", _num(2)), "handoff CPU ms": ("handoff_cpu_s", _ms),
    "other cores": ("other_cores", _num(2)),
    "errors": ("errors", str), "fallbacks": ("fallbacks", str),
}  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """The summary rows as a text table."""
    ordered = sorted(rows, key=lambda r: (r["length"], r["phase"], SETUPS.index(r["setup"])))
    lines = [list(COLUMNS)]
    lines += [[fmt(r[key]) for key, fmt in COLUMNS.values()] for r in ordered]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    text = [" | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join([text[0], "-" * len(text[0]), *text[1:]])


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
    for dist in ("vllm-cpu", "torch", "nixl", "nixl-cu12"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[dist] = importlib.metadata.version(dist)
    info["git"] = _git("rev-parse", "HEAD")
    info["git_dirty"] = _git("status", "--porcelain", "--untracked-files=no").splitlines()
    return info


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def run(settings: Settings, workdir: Path) -> dict[str, Any]:
    """Every setup in turn; the whole record (samples, summaries, headline)."""
    from fabric.models.tiny import make_tiny_model

    model_dir = make_tiny_model(workdir / "models" / "tiny-kv-heavy", kv_heavy=True)
    record: dict[str, Any] = {"settings": asdict(settings), "workdir": str(workdir)}
    record["machine"] = machine_info()
    record["load_avg_start"] = load_avg()
    record["runs"] = []
    timeout = httpx.Timeout(settings.request_timeout_s, connect=10.0)
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        for round_ in range(settings.rounds):
            for setup in settings.setups:
                say(f"{setup}: starting (round {round_ + 1} of {settings.rounds})")
                run = run_setup(setup, round_, settings, model_dir, workdir, client)
                record["runs"].append(run)
    record["load_avg_end"] = load_avg()
    samples = [s for run in record["runs"] for s in run["samples"]]
    record["summary"] = summarize(samples)
    record["ratios"] = ratios(record["summary"], settings.lengths)
    record["token_matches_colocated"] = token_matches(samples)
    record["headline"] = headline(record["summary"], settings.lengths)
    return record


OPTIONS = ("requests", "proxied_requests", "warmup", "max_tokens", "threads", "spin_threshold",
           "kv_cache_gib", "store_mib", "max_num_batched_tokens", "quiet_cores",
           "quiet_wait_s", "rounds")  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, Path | None, Path]:
    """Settings, work dir (None: a new temp dir) and results dir from the command line."""
    p = argparse.ArgumentParser(prog="benchmarks/pd_vs_nixl.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1k only, 2 requests, 1 proxied, 1 round")
    p.add_argument("--lengths", help="prompt lengths, comma-separated (default 1024,4096)")
    p.add_argument("--requests", type=int, help="client-phase requests per point (default 5)")
    p.add_argument("--proxied-requests", type=int, help="proxied requests per point (default 2)")
    p.add_argument("--warmup", type=int, help="warm-up requests per length (default 1)")
    p.add_argument("--max-tokens", type=int, help="output tokens per request (default 32)")
    p.add_argument("--setups", help="comma-separated subset/order of fabric,nixl,colocated")
    p.add_argument("--threads", choices=["tuned", "shipped"], help="thread pinning (see doc)")
    p.add_argument("--spin-threshold", type=float, help="idle core share of a busy poller")
    p.add_argument("--kv-cache-gib", type=int, help="KV pool per engine (default 1)")
    p.add_argument("--store-mib", type=int, help="fabric chunk store per engine (default 768)")
    p.add_argument("--max-num-batched-tokens", type=int, help="vLLM's step budget (default 2048)")
    p.add_argument("--quiet-cores", type=float, help="others' CPU a request waits out (0.3)")
    p.add_argument("--rounds", type=int, help="interleave the setups this many times (2)")
    p.add_argument("--quiet-wait-s", type=float, help="longest wait for quiet, 0: none (90)")
    p.add_argument("--workdir", type=Path, help="engine logs and caches (default: a temp dir)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ns = p.parse_args(argv)
    settings = (
        Settings(lengths=(1024,), requests=2, proxied_requests=1, rounds=1, quick=True)
        if ns.quick
        else Settings()
    )
    changes: dict[str, Any] = {}
    if ns.lengths:
        changes["lengths"] = tuple(int(n) for n in ns.lengths.split(","))
    if ns.setups:
        changes["setups"] = tuple(s.strip() for s in ns.setups.split(","))
        unknown = set(changes["setups"]) - set(SETUPS)
        if unknown:
            p.error(f"--setups: unknown {sorted(unknown)}; known: {', '.join(SETUPS)}")
    for name in OPTIONS:
        if getattr(ns, name) is not None:
            changes[name] = getattr(ns, name)
    settings = replace(settings, **changes)
    if settings.rounds < 1 or settings.requests < settings.rounds:
        p.error("--rounds: between 1 and --requests")
    if max(settings.lengths) + settings.max_tokens + 1 > settings.max_model_len:
        settings = replace(settings, max_model_len=max(settings.lengths) + 512)
    return settings, ns.workdir, ns.results_dir


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block, so every ``finally`` runs."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table, save the JSON, end with the headline JSON line."""
    settings, workdir, results_dir = parse_args(argv)
    workdir = (workdir or Path(tempfile.mkdtemp(prefix="pd_vs_nixl-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"work dir (engine logs): {workdir}")
    try:
        with stop_on_signals():
            record = run(settings, workdir)
    except KeyboardInterrupt as exc:
        say(f"interrupted ({exc or 'SIGINT'}); every process was stopped")
        return 130
    print(table(record["summary"]))
    print(f"token ids equal to colocated: {record['token_matches_colocated']}")
    print(f"ratios: {json.dumps(record['ratios'])}")
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = "pd_vs_nixl-quick" if settings.quick else "pd_vs_nixl"
    path = results_dir / f"{kind}-{stamp}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    print(json.dumps(record["headline"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
