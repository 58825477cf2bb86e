"""Staged or direct, per decoder link, by what each path cost on that link.

A prefiller with ``direct_reads: auto`` moves a held push's KV one of two ways:

- **staged**: its pack thread packs each chunk into a pool slot (one copy,
  the checksum taken in it) and the link's push thread WRITEs the slot into
  the decoder's reserved slot;
- **direct**: its pack thread hashes the chunk where it lies in the KV
  cache and the push thread offers the block ids; the decoder READs them
  (:mod:`fabric.kv.direct`), so the copy runs on the decoder's side.

Which is cheaper depends on the link, not on a rule: over shared memory
(UCX ``cma``) or RDMA a READ costs the prefiller nothing, while over UCX's
TCP transport a READ is emulated with messages the prefiller's own thread
must progress, and it is slower than a WRITE. So :class:`PathChooser`
measures, per decoder endpoint, what each push cost:

- ``cpu_s``: CPU seconds the prefiller's fabric threads spent on it -- the
  pack thread's packing or hashing of its chunks (during the forward, too)
  and the link thread's handling of its writes, offers and their polls,
  not its Reserve (``time.thread_time``, the calling thread's own CPU;
  kept on the push's :class:`~fabric.integrations.vllm.sender.PushJob`) --
  per MiB pushed: the core a prefiller's forward shares;
- ``tail_s``: from the pack thread handing over the push's last chunk (or
  the Reserve's answer, if later: a link's first push also connects) to
  the push being over: what the decoder still waits for once the prefill
  ended.

It picks the path whose expected cost to the request's first token is the
lower: ``cpu_per_mib * MiB + tail_weight * tail_s``, the push's MiB times
its CPU per MiB (on an engine whose forward shares its core with fabric's
threads, as on a CPU, that CPU is time taken from the prefill) plus the
time the decoder still waits after it. (A rule on the tails' ratio alone
flipped to staged on a few ms of tail noise, 2026-12-07, and cost the
prefill 2-4%.) Until each path has ``min_pushes`` measured pushes on a
link, the less measured one goes (direct first once the decoder is known to
read); after that, every ``explore_every``-th choice on the link takes the
other path, so an estimate that went stale (a link now busier) is measured
again. Estimates are moving averages (weight ``alpha`` for the newest
push). A path whose last ``max_failures`` pushes on a link all failed (a
decoder that refuses offers, READs that break on that link) is not chosen
but to explore it again, so a path that cannot work there never keeps
every push failing.

What it does not see: the decoder's own CPU (a direct READ copies on the
decoder's core, which also decodes other requests), and the forward's
slowdown from memory traffic the decoder's copies cause on a shared
memory bus. A failed push adds no cost (what it spent says nothing of the
path's); one whose write, offer or READ failed counts as a failure of its
path (one whose request ended early, a client that left, does not), and
one that landed ends the path's run of failures. With NIXL's progress
thread on, the UCX work of an emulated READ runs on that thread, which no
fabric thread's CPU includes. A decoder whose HelloAck says it does not read (``reads`` false:
an older fabric, a data plane that cannot read) gets staged pushes only.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

STAGED = "staged"
DIRECT = "direct"
PATHS = (STAGED, DIRECT)

MAX_LINKS = 256
"""Links remembered at most (the least recently used one goes first)."""


def preferred(
    costs: dict[str, tuple[float, float]], mib: float = 1.0, tail_weight: float = 1.0
) -> str:
    """The path ``auto`` prefers, from each path's ``(cpu_per_mib_s,
    tail_s)``, for a push of ``mib`` MiB: the lower ``cpu_per_mib_s * mib +
    tail_weight * tail_s`` (a tie goes to direct). Also what ``fabric bench
    transfer`` reports as fabric's pick (its CPU per transfer, ``mib`` 1)."""
    cost = {path: cpu * mib + tail_weight * tail for path, (cpu, tail) in costs.items()}
    return DIRECT if cost[DIRECT] <= cost[STAGED] else STAGED


@dataclass
class PathEstimate:
    """One path's measured cost on one link: moving averages over its pushes."""

    pushes: int = 0
    cpu_per_mib_s: float = 0.0
    tail_s: float = 0.0
    failures: int = 0  # pushes that failed in a row (0 after one that landed)

    def add(self, cpu_per_mib_s: float, tail_s: float, alpha: float) -> None:
        if self.pushes == 0:
            self.cpu_per_mib_s, self.tail_s = cpu_per_mib_s, tail_s
        else:
            self.cpu_per_mib_s += alpha * (cpu_per_mib_s - self.cpu_per_mib_s)
            self.tail_s += alpha * (tail_s - self.tail_s)
        self.pushes += 1
        self.failures = 0


@dataclass
class LinkPaths:
    """What is known of one decoder link."""

    reads: bool | None = None  # whether the decoder serves offers (None: not known yet)
    chosen: int = 0  # pushes a path was chosen for
    recorded: int = 0  # pushes recorded (landed or not)
    estimates: dict[str, PathEstimate] = field(
        default_factory=lambda: {path: PathEstimate() for path in PATHS}
    )
    choice: str = STAGED  # the path the estimates prefer (reported)


class PathChooser:
    """Per decoder endpoint: which path a push takes (see the module docstring).

    Thread-safe: the pack thread chooses, each link's push thread records
    the pushes that ended.
    """

    def __init__(
        self,
        *,
        min_pushes: int = 2,
        explore_every: int = 16,
        tail_weight: float = 1.0,
        alpha: float = 0.25,
        max_failures: int = 2,
    ) -> None:
        if min_pushes < 1 or explore_every < 2 or tail_weight < 0 or not 0 < alpha <= 1:
            raise ValueError(
                "min_pushes >= 1, explore_every >= 2, tail_weight >= 0, 0 < alpha <= 1"
            )
        self.min_pushes = min_pushes
        self.explore_every = explore_every
        self.tail_weight = tail_weight
        self.alpha = alpha
        self.max_failures = max_failures
        self._lock = threading.Lock()
        self._links: dict[str, LinkPaths] = {}

    # ------------------------------------------------------------ choosing
    def choose(self, endpoint: str, nbytes: int = 2**20) -> str:
        """The path the next push to ``endpoint``, of ``nbytes``, takes."""
        with self._lock:
            link = self._link(endpoint)
            link.chosen += 1
            if not link.reads:
                return STAGED  # NOTE: not known to read yet (its first Hello is to come)
            explore = link.chosen % self.explore_every == 0
            staged, direct = link.estimates[STAGED], link.estimates[DIRECT]
            failing = [p for p in PATHS if link.estimates[p].failures >= self.max_failures]
            if len(failing) == 1:
                other = DIRECT if failing[0] == STAGED else STAGED
                return failing[0] if explore else other
            if min(staged.pushes, direct.pushes) < self.min_pushes:
                return DIRECT if direct.pushes <= staged.pushes else STAGED
            best = self._preferred(link, nbytes / 2**20)
            if explore:
                return STAGED if best == DIRECT else DIRECT
            return best

    def _preferred(self, link: LinkPaths, mib: float = 1.0) -> str:
        costs = {p: (e.cpu_per_mib_s, e.tail_s) for p, e in link.estimates.items()}
        choice = preferred(costs, mib, self.tail_weight)
        if choice != link.choice:
            logger.info(
                "fabric: direct_reads auto: a link now prefers %s (CPU ms per MiB, tail ms: %s)",
                choice,
                {p: (round(c * 1000, 3), round(t * 1000, 1)) for p, (c, t) in costs.items()},
            )
        link.choice = choice
        return link.choice

    def set_reads(self, endpoint: str, reads: bool) -> None:
        """Whether the decoder at ``endpoint`` serves offers (its HelloAck says)."""
        with self._lock:
            self._link(endpoint).reads = reads

    # ------------------------------------------------------------ measuring
    def record(
        self,
        endpoint: str,
        path: str,
        cpu_s: float,
        nbytes: int,
        tail_s: float,
        ok: bool,
        *,
        failed: bool = False,
    ) -> None:
        """A push to ``endpoint`` over ``path`` is over: when ``ok`` (every
        chunk landed) and it moved bytes, what it cost counts for ``path``;
        when the path itself ``failed`` (a write, offer or READ; not a push
        its request ended early), it counts as one of the path's failures."""
        if path not in PATHS:
            return
        with self._lock:
            link = self._link(endpoint)
            link.recorded += 1
            estimate = link.estimates[path]
            if not ok:
                estimate.failures += 1 if failed else 0
                return
            estimate.failures = 0
            if nbytes <= 0:
                return
            estimate.add(cpu_s / (nbytes / 2**20), max(0.0, tail_s), self.alpha)
            if min(e.pushes for e in link.estimates.values()) >= self.min_pushes:
                self._preferred(link, nbytes / 2**20)

    # ------------------------------------------------------------ reporting
    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per endpoint: reads, the preferred path and each path's estimate."""
        with self._lock:
            return {
                endpoint: {
                    "reads": link.reads,
                    "choice": link.choice,
                    "recorded": link.recorded,
                    **{
                        path: {
                            "pushes": est.pushes,
                            "cpu_ms_per_mib": round(est.cpu_per_mib_s * 1000, 4),
                            "tail_ms": round(est.tail_s * 1000, 3),
                            "failures": est.failures,
                        }
                        for path, est in link.estimates.items()
                    },
                }
                for endpoint, link in self._links.items()
            }

    def table_sizes(self) -> dict[str, int]:
        with self._lock:
            return {"paths_links": len(self._links)}

    def _link(self, endpoint: str) -> LinkPaths:
        link = self._links.pop(endpoint, None) or LinkPaths()
        self._links[endpoint] = link  # NOTE: most recently used last
        while len(self._links) > MAX_LINKS:
            del self._links[next(iter(self._links))]
        return link
