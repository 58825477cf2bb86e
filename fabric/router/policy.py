"""Routing policies: which prefiller and which decoder serve a request.

A :class:`Policy` chooses one engine of one role among candidates (healthy
ones) for a request body. Each role has its own policy instance
(``proxy.prefill_policy`` / ``proxy.decode_policy``, both defaulting to
``proxy.policy``), combined by :class:`Routing` into the (P, D) pair; P is
None when no prefiller is a candidate (no healthy one, none whose pair with
the chosen decoder may be used, or the prompt is too short to
disaggregate), and the decoder then computes the prompt itself. A draining
engine is never picked (:class:`Routing` drops it from the candidates).

Pairs are ranked (:data:`PairRank`, from :mod:`fabric.router.ready`): a
pair whose canary failed is never used; a pair checked by a canary (ok, or
unverified: nothing showed it broken) is preferred over a pending one (not
checked since an engine came back). So right after an engine restarts, its
pending pairs get requests only when no checked pair exists for the
request: a decoder with only pending pairs is not picked while another has
a checked one (a decoder with no usable pair at all still is: it computes
prompts itself), and a prefiller with a pending pair to the chosen decoder
is not picked while another's pair with it is checked.

Load is ``Engine.outstanding``: a decoder counts a request from the moment
it is picked until its answer ends (its prefill included), a prefiller
while it prefills.

Cache-aware: the engine whose fabric store holds the longest prefix of the
prompt (``hints``: engine name -> prefix tokens held, looked up by the proxy
before it picks, see :mod:`fabric.router.prefix`), unless it is overloaded
compared with the least loaded one; otherwise least outstanding. For
prefillers a hit saves prefill compute; for decoders it saves transfer (a
chunk the decoder holds is not pushed again).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fabric.config import ProxyConfig
from fabric.errors import ConfigError
from fabric.router.engines import Engine

Hints = Mapping[str, int] | None
"""Engine name -> prompt tokens its store holds (cache-aware routing)."""

PairRank = Callable[[Engine, Engine], int | None]
"""How (prefiller, decoder) may serve a request together: None not at all,
else the lower the better (only the best rank among candidates is used)."""


class Policy(ABC):
    """Chooses one engine of a role for each request."""

    name: str = ""

    needs_hints = False  # whether pick wants the prefix hints (costs lookups)

    @abstractmethod
    def pick(
        self, engines: Sequence[Engine], body: Mapping[str, Any], hints: Hints = None
    ) -> Engine:
        """The engine for ``body``; ``engines`` is never empty."""

    def on_finish(self, engine: Engine, ok: bool) -> None:  # noqa: B027
        """Called when a request this policy routed to ``engine`` ends. No-op by default."""


class RoundRobin(Policy):
    """Engines taken in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self, engines: Sequence[Engine], body: Mapping[str, Any], hints: Hints = None
    ) -> Engine:
        """The next engine."""
        engine = engines[self._next % len(engines)]
        self._next += 1
        return engine


class LeastOutstanding(Policy):
    """The engine with the fewest requests in flight; ties taken in turn."""

    name = "least_outstanding"

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self, engines: Sequence[Engine], body: Mapping[str, Any], hints: Hints = None
    ) -> Engine:
        """The least loaded engine, the first after the last pick on a tie."""
        n = len(engines)
        start = self._next % n
        self._next += 1
        best = engines[start]
        for i in range(1, n):
            engine = engines[(start + i) % n]
            if engine.outstanding < best.outstanding:
                best = engine
        return best


class CacheAware(Policy):
    """The engine holding the longest prefix, within a load bound; else least loaded."""

    name = "cache_aware"
    needs_hints = True

    def __init__(self, max_imbalance: int = 4) -> None:
        self.max_imbalance = max_imbalance
        self._fallback = LeastOutstanding()

    def pick(
        self, engines: Sequence[Engine], body: Mapping[str, Any], hints: Hints = None
    ) -> Engine:
        """Most prefix tokens held (fewest outstanding on a tie), unless overloaded."""
        least = self._fallback.pick(engines, body)
        if not hints:
            return least
        best = max(engines, key=lambda e: (hints.get(e.name, 0), -e.outstanding))
        if hints.get(best.name, 0) <= hints.get(least.name, 0):
            return least
        if best.outstanding > least.outstanding + self.max_imbalance:
            return least
        return best


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastOutstanding, CacheAware)}


class Routing:
    """A prefill policy and a decode policy: the (P, D) pair of each request."""

    def __init__(self, prefill: Policy, decode: Policy) -> None:
        self.prefill = prefill
        self.decode = decode

    @classmethod
    def from_config(cls, config: ProxyConfig) -> Routing:
        """Per-role policies of ``config`` (each role defaults to ``policy``)."""
        imbalance = config.cache_aware_max_imbalance
        prefill_name = config.prefill_policy or config.policy
        decode_name = config.decode_policy or config.policy
        prefill = make_policy(prefill_name, "proxy.prefill_policy", max_imbalance=imbalance)
        decode = make_policy(decode_name, "proxy.decode_policy", max_imbalance=imbalance)
        return cls(prefill, decode)

    @property
    def needs_hints(self) -> bool:
        return self.prefill.needs_hints or self.decode.needs_hints

    def pick(
        self,
        prefillers: Sequence[Engine],
        decoders: Sequence[Engine],
        body: Mapping[str, Any],
        hints: Hints = None,
        rank: PairRank | None = None,
    ) -> tuple[Engine | None, Engine]:
        """The pair for ``body``, never a draining engine, best ranked pairs
        first (see the module docstring): P None when no prefiller is left
        (none may pair with D). ValueError when no decoder is: callers check."""
        decoders = [e for e in decoders if not e.draining]
        if not decoders:
            raise ValueError("no decoder to pick: every candidate is draining")
        prefillers = [e for e in prefillers if not e.draining]
        if rank is not None and prefillers:
            decoders = _best_decoders(decoders, prefillers, rank)
        decode = self.decode.pick(decoders, body, hints)
        if rank is not None:
            prefillers = _best_prefillers(prefillers, decode, rank)
        prefill = self.prefill.pick(prefillers, body, hints) if prefillers else None
        return prefill, decode

    def on_finish(self, prefill: Engine | None, decode: Engine, ok: bool) -> None:
        """Tell both policies that a request ended."""
        if prefill is not None:
            self.prefill.on_finish(prefill, ok)
        self.decode.on_finish(decode, ok)


def _best_decoders(
    decoders: list[Engine], prefillers: list[Engine], rank: PairRank
) -> list[Engine]:
    """Decoders whose best pair ranks best; those without a usable pair stay."""
    best = {d: _best_rank(prefillers, d, rank) for d in decoders}
    top = min((r for r in best.values() if r is not None), default=None)
    return [d for d in decoders if best[d] is None or best[d] == top]


def _best_prefillers(prefillers: list[Engine], decode: Engine, rank: PairRank) -> list[Engine]:
    """Prefillers whose pair with ``decode`` ranks best (none may: [])."""
    top = _best_rank(prefillers, decode, rank)
    return [p for p in prefillers if top is not None and rank(p, decode) == top]


def _best_rank(prefillers: list[Engine], decode: Engine, rank: PairRank) -> int | None:
    return min((r for p in prefillers if (r := rank(p, decode)) is not None), default=None)


def make_policy(name: str, field: str = "proxy.policy", *, max_imbalance: int = 4) -> Policy:
    """A new policy by its config name."""
    try:
        kind = POLICIES[name]
    except KeyError:
        known = ", ".join(POLICIES)
        raise ConfigError(f"{field}: unknown policy {name!r}; known: {known}") from None
    return CacheAware(max_imbalance) if kind is CacheAware else kind()
