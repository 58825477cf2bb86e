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
  and the link thread's handling of its writes, offers and their polls
  (``time.thread_time``, the calling thread's own CPU) -- per byte pushed:
  the core a prefiller's forward shares;
- ``tail_s``: from the link thread taking the push's last chunk to the push
  being over: what the decoder still waits for once the prefill ended.

It picks the path with the lower CPU per byte, unless that path's tail is
over ``tail_factor`` times the other's (plus ``tail_slack_s``): a path that
spares the prefiller's core but makes the decoder wait much longer for the
last chunk loses. Until each path has ``min_pushes`` measured pushes on a
link, pushes alternate (direct first once the decoder is known to read);
after that, every ``explore_every``-th push takes the other path, so an
estimate that went stale (a link now busier) is measured again. Estimates
are moving averages (weight ``alpha`` for the newest push).

What it does not see: the decoder's own CPU (a direct READ copies on the
decoder's core, which also decodes other requests), and the forward's
slowdown from memory traffic the decoder's copies cause on a shared
memory bus. A push that failed records nothing (its cost says nothing of
the path's); a decoder that refuses offers (``reads`` false: an older
fabric, a tcp transport, a GPU cache) gets staged pushes only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

STAGED = "staged"
DIRECT = "direct"
PATHS = (STAGED, DIRECT)

MAX_LINKS = 256
"""Links remembered at most (the least recently used one goes first)."""
MAX_COSTS = 4096
"""Pushes whose cost is being added up at most (the oldest one goes first)."""


@dataclass
class PathEstimate:
    """One path's measured cost on one link: moving averages over its pushes."""

    pushes: int = 0
    cpu_per_mib_s: float = 0.0
    tail_s: float = 0.0

    def add(self, cpu_per_mib_s: float, tail_s: float, alpha: float) -> None:
        if self.pushes == 0:
            self.cpu_per_mib_s, self.tail_s = cpu_per_mib_s, tail_s
        else:
            self.cpu_per_mib_s += alpha * (cpu_per_mib_s - self.cpu_per_mib_s)
            self.tail_s += alpha * (tail_s - self.tail_s)
        self.pushes += 1


@dataclass
class LinkPaths:
    """What is known of one decoder link."""

    reads: bool | None = None  # whether the decoder serves offers (None: not known yet)
    chosen: int = 0  # pushes a path was chosen for
    estimates: dict[str, PathEstimate] = field(
        default_factory=lambda: {path: PathEstimate() for path in PATHS}
    )
    choice: str = STAGED  # the path the estimates prefer (reported)


class PathChooser:
    """Per decoder endpoint: which path a push takes (see the module docstring).

    Thread-safe: the pack thread chooses and adds its CPU, each link's push
    thread adds its own and records the push's end.
    """

    def __init__(
        self,
        *,
        min_pushes: int = 2,
        explore_every: int = 16,
        tail_factor: float = 2.0,
        tail_slack_s: float = 0.005,
        alpha: float = 0.25,
    ) -> None:
        if min_pushes < 1 or explore_every < 2 or tail_factor < 1 or not 0 < alpha <= 1:
            raise ValueError(
                "min_pushes >= 1, explore_every >= 2, tail_factor >= 1, 0 < alpha <= 1"
            )
        self.min_pushes = min_pushes
        self.explore_every = explore_every
        self.tail_factor = tail_factor
        self.tail_slack_s = tail_slack_s
        self.alpha = alpha
        self._lock = threading.Lock()
        self._links: dict[str, LinkPaths] = {}
        self._costs: dict[str, float] = {}  # req_id -> CPU seconds added so far

    # ------------------------------------------------------------ choosing
    def choose(self, endpoint: str) -> str:
        """The path the next push to ``endpoint`` takes."""
        with self._lock:
            link = self._link(endpoint)
            link.chosen += 1
            if not link.reads:
                return STAGED  # NOTE: not known to read yet (its first Hello is to come)
            staged, direct = link.estimates[STAGED], link.estimates[DIRECT]
            if min(staged.pushes, direct.pushes) < self.min_pushes:
                return DIRECT if direct.pushes <= staged.pushes else STAGED
            best = self._preferred(link)
            if link.chosen % self.explore_every == 0:
                return STAGED if best == DIRECT else DIRECT
            return best

    def _preferred(self, link: LinkPaths) -> str:
        staged, direct = link.estimates[STAGED], link.estimates[DIRECT]
        cheaper, other = (
            (direct, staged) if direct.cpu_per_mib_s <= staged.cpu_per_mib_s else (staged, direct)
        )
        if cheaper.tail_s > self.tail_factor * other.tail_s + self.tail_slack_s:
            cheaper, other = other, cheaper
        link.choice = DIRECT if cheaper is direct else STAGED
        return link.choice

    def set_reads(self, endpoint: str, reads: bool) -> None:
        """Whether the decoder at ``endpoint`` serves offers (its HelloAck says)."""
        with self._lock:
            self._link(endpoint).reads = reads

    # ------------------------------------------------------------ measuring
    def begin(self, req_id: str) -> None:
        """``req_id``'s push is measured from now (its CPU is added up until
        :meth:`record` or :meth:`forget`)."""
        with self._lock:
            self._costs[req_id] = 0.0
            while len(self._costs) > MAX_COSTS:
                del self._costs[next(iter(self._costs))]

    def add_cpu(self, req_id: str, seconds: float) -> None:
        """CPU a fabric thread spent on ``req_id``'s push (nothing for a push
        not measured, or over)."""
        if seconds <= 0:
            return
        with self._lock:
            if req_id in self._costs:
                self._costs[req_id] += seconds

    def record(
        self, endpoint: str, req_id: str, path: str, nbytes: int, tail_s: float, ok: bool
    ) -> None:
        """``req_id``'s push to ``endpoint`` is over: its cost counts for
        ``path`` when it ``ok`` (every chunk landed) and moved bytes."""
        with self._lock:
            cpu_s = self._costs.pop(req_id, 0.0)
            if not ok or nbytes <= 0 or path not in PATHS:
                return
            link = self._link(endpoint)
            link.estimates[path].add(cpu_s / (nbytes / 2**20), max(0.0, tail_s), self.alpha)
            if min(e.pushes for e in link.estimates.values()) >= self.min_pushes:
                self._preferred(link)

    def forget(self, req_id: str) -> None:
        """Drop what was added for ``req_id`` (its push never began)."""
        with self._lock:
            self._costs.pop(req_id, None)

    # ------------------------------------------------------------ reporting
    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per endpoint: reads, the preferred path and each path's estimate."""
        with self._lock:
            return {
                endpoint: {
                    "reads": link.reads,
                    "choice": link.choice,
                    **{
                        path: {
                            "pushes": est.pushes,
                            "cpu_ms_per_mib": round(est.cpu_per_mib_s * 1000, 4),
                            "tail_ms": round(est.tail_s * 1000, 3),
                        }
                        for path, est in link.estimates.items()
                    },
                }
                for endpoint, link in self._links.items()
            }

    def table_sizes(self) -> dict[str, int]:
        with self._lock:
            return {"paths_links": len(self._links), "paths_costs": len(self._costs)}

    def _link(self, endpoint: str) -> LinkPaths:
        link = self._links.pop(endpoint, None) or LinkPaths()
        self._links[endpoint] = link  # NOTE: most recently used last
        while len(self._links) > MAX_LINKS:
            del self._links[next(iter(self._links))]
        return link
