"""Routing policies: which prefiller and which decoder serve a request.

A :class:`Policy` chooses one engine of one role among candidates (healthy
ones) for a request body. Each role has its own policy instance
(``proxy.prefill_policy`` / ``proxy.decode_policy``, both defaulting to
``proxy.policy``), combined by :class:`Routing` into the (P, D) pair; P is
None when no prefiller is a candidate (no healthy one, or the prompt is too
short to disaggregate), and the decoder then computes the prompt itself.

Load is ``Engine.outstanding``: a decoder counts a request from the moment
it is picked until its answer ends (its prefill included), a prefiller
while it prefills.

Planned: cache-aware (the pair whose store holds the longest prefix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from fabric.config import ProxyConfig
from fabric.errors import ConfigError
from fabric.router.engines import Engine


class Policy(ABC):
    """Chooses one engine of a role for each request."""

    name: str = ""

    @abstractmethod
    def pick(self, engines: Sequence[Engine], body: Mapping[str, Any]) -> Engine:
        """The engine for ``body``; ``engines`` is never empty."""

    def on_finish(self, engine: Engine, ok: bool) -> None:  # noqa: B027
        """Called when a request this policy routed to ``engine`` ends. No-op by default."""


class RoundRobin(Policy):
    """Engines taken in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, engines: Sequence[Engine], body: Mapping[str, Any]) -> Engine:
        """The next engine."""
        engine = engines[self._next % len(engines)]
        self._next += 1
        return engine


class LeastOutstanding(Policy):
    """The engine with the fewest requests in flight; ties taken in turn."""

    name = "least_outstanding"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, engines: Sequence[Engine], body: Mapping[str, Any]) -> Engine:
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


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastOutstanding)}


class Routing:
    """A prefill policy and a decode policy: the (P, D) pair of each request."""

    def __init__(self, prefill: Policy, decode: Policy) -> None:
        self.prefill = prefill
        self.decode = decode

    @classmethod
    def from_config(cls, config: ProxyConfig) -> Routing:
        """Per-role policies of ``config`` (each role defaults to ``policy``)."""
        prefill = make_policy(config.prefill_policy or config.policy, "proxy.prefill_policy")
        decode = make_policy(config.decode_policy or config.policy, "proxy.decode_policy")
        return cls(prefill, decode)

    def pick(
        self, prefillers: Sequence[Engine], decoders: Sequence[Engine], body: Mapping[str, Any]
    ) -> tuple[Engine | None, Engine]:
        """The pair for ``body``: P None when ``prefillers`` is empty; ``decoders`` is not."""
        decode = self.decode.pick(decoders, body)
        prefill = self.prefill.pick(prefillers, body) if prefillers else None
        return prefill, decode

    def on_finish(self, prefill: Engine | None, decode: Engine, ok: bool) -> None:
        """Tell both policies that a request ended."""
        if prefill is not None:
            self.prefill.on_finish(prefill, ok)
        self.decode.on_finish(decode, ok)


def make_policy(name: str, field: str = "proxy.policy") -> Policy:
    """A new policy by its config name."""
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(POLICIES)
        raise ConfigError(f"{field}: unknown policy {name!r}; known: {known}") from None
