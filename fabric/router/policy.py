"""Routing policies: which prefiller and which decoder serve a request.

A :class:`Policy` sees the candidate engines (healthy ones; prefillers may be
none, then the decoder computes the prompt itself) and the request body, and
returns the pair. Policies that need to know when a request ends (to count
load or learn what a store holds) override the no-op hooks.

Planned: least outstanding requests (``Engine.outstanding`` is maintained
for it) and cache-aware (the pair whose store holds the longest prefix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from fabric.errors import ConfigError
from fabric.router.engines import Engine


class Policy(ABC):
    """Chooses the (prefill, decode) pair of each request."""

    @abstractmethod
    def pick(
        self, prefillers: Sequence[Engine], decoders: Sequence[Engine], body: Mapping[str, Any]
    ) -> tuple[Engine | None, Engine]:
        """The pair for ``body``; ``None`` as prefiller only when ``prefillers`` is empty.

        ``decoders`` is never empty.
        """

    def on_finish(self, prefill: Engine | None, decode: Engine, ok: bool) -> None:  # noqa: B027
        """Called when a request routed by this policy ends. No-op by default."""


class RoundRobin(Policy):
    """Prefillers and decoders each taken in turn, independently."""

    def __init__(self) -> None:
        self._next_prefill = 0
        self._next_decode = 0

    def pick(
        self, prefillers: Sequence[Engine], decoders: Sequence[Engine], body: Mapping[str, Any]
    ) -> tuple[Engine | None, Engine]:
        """The next prefiller and the next decoder."""
        decode = decoders[self._next_decode % len(decoders)]
        self._next_decode += 1
        if not prefillers:
            return None, decode
        prefill = prefillers[self._next_prefill % len(prefillers)]
        self._next_prefill += 1
        return prefill, decode


POLICIES: dict[str, type[Policy]] = {"round_robin": RoundRobin}


def make_policy(name: str) -> Policy:
    """A new policy by its config name."""
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(POLICIES)
        raise ConfigError(f"proxy.policy: unknown policy {name!r}; known: {known}") from None
