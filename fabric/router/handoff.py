"""Early admission: the decoder gets its request when the prefiller does.

With ``proxy.handoff: early`` (the default) the proxy sends D the client's
request at dispatch, with ``kv_transfer_params`` naming the transfer, and P
its prefill at the same time. D allocates the prompt's blocks at once and
its loader unpacks each chunk P pushes as it lands, while P still computes
the rest; D's first token comes when the last chunk is in. P's answer only
reports success or an error. ::

    client --> proxy --prefill (max_tokens=1, kv_transfer_params -> D)--> P
                 |  --request (do_remote_prefill, transfer_id)----------> D
                 |  --PrefillState(running) every HEARTBEAT_S ---------> D's kv_port
                 |<-- P answers: PrefillState(done), or on any failure
                 |    PrefillState(failed): D's load fails now and vLLM
                 |    recomputes the prompt on D at once
    client <-----|<-- D's answer, relayed as it comes

D's wait for the KV is bounded by the prefill's progress rather than a
fixed ``load_timeout_s``: while the proxy keeps saying ``running`` (every
``HEARTBEAT_S``, each word good for ``RUNNING_TTL_MS``) the load waits; if
the word stops (the proxy died) it fails within ``RUNNING_TTL_MS``; once P
answered, the usual bounds count from then (see
:mod:`fabric.integrations.vllm.loader`). A P that dies, times out, answers
an error or no ``kv_transfer_params``, or is marked down by the health
probe (its legs are cancelled), is a failure the proxy reports at once.

Admission: D holds the prompt's blocks for the whole prefill, and vLLM
never preempts a request waiting for remote KV, so a decoder admits early
at most ``proxy.early_max_tokens`` estimated prompt tokens at once from
this proxy (0: no bound); past it the request takes the sequential flow (D
after P answers), counted as ``early_refused``. So does a decoder whose
kv port refused a word (a fabric release without early handoff: it would
refuse the params and compute every prompt while P computes it too), until
``REFUSED_RETRY_S``, and one whose kv port stopped answering words, until
one is answered again (an empty word asks it every ``HEARTBEAT_S``).

The words go over clients of their own (:class:`~fabric.router.stores.StoreCalls`
bounded by ``WORD_TIMEOUT_MS``), so cache-aware lookups that time out never
back them off, and the reverse. :class:`Handoff` keeps the transfers D
waits on, by D's kv endpoint (the ``early_transfers`` table), and says the
word about them; words that did not go through are counted
(``prefill_words_failed``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fabric.errors import FabricError, PeerUnreachable

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
"""How often the proxy says ``running`` for the transfers D waits on."""

RUNNING_TTL_MS = 4000
"""How long one ``running`` holds on D: a dead proxy's loads fail this long after its last word."""

WORD_TIMEOUT_MS = 1000
"""Bound of one word's call."""

REFUSED_RETRY_S = 60.0
"""How long a decoder that refused a word gets the sequential flow before it is tried again."""

FINAL_TTL_MS = 1
"""``ttl_ms`` of ``done`` and ``failed`` (final: the ttl means nothing there)."""

MAX_IDS_PER_MESSAGE = 1024
"""Transfers named in one ``PrefillState`` (the server takes up to 4096)."""


def early_params(transfer_id: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` D gets at dispatch: load ``transfer_id``.

    No ``num_tokens``: the proxy does not tokenize; the decoder checks that
    the pushed chunk keys are its own prompt's before a byte is used.
    """
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id}


Call = Callable[..., Coroutine[Any, Any, Any]]


class Handoff:
    """The transfers decoders wait on, and the proxy's word about them.

    ``call(endpoint, "prefill_state", ids, state, ttl_ms=..., reason=...)``
    sends one ``PrefillState`` (the proxy's :class:`~fabric.router.stores.StoreCalls`).
    """

    def __init__(self, call: Call, *, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.call = call
        self.heartbeat_s = heartbeat_s
        self.running: dict[str, set[str]] = {}  # D's kv endpoint -> transfers it waits on
        self.refused: dict[str, float] = {}  # kv endpoint that refused a word -> retry after
        self.silent: set[str] = set()  # kv endpoints whose last word got no answer
        self._sends: set[asyncio.Task[None]] = set()
        self.failed_words = 0  # PrefillState calls that did not go through

    def admits(self, endpoint: str) -> bool:
        """Whether the decoder at ``endpoint`` takes early handoffs now."""
        if endpoint in self.silent:
            return False
        until = self.refused.get(endpoint)
        if until is not None and time.monotonic() < until:
            return False
        self.refused.pop(endpoint, None)
        return True

    @property
    def waiting(self) -> int:
        """Transfers some decoder waits on (the ``early_transfers`` table)."""
        return sum(len(ids) for ids in self.running.values())

    def start(self, endpoint: str, transfer_id: str) -> None:
        """D at ``endpoint`` waits for ``transfer_id``: say ``running`` now, and on."""
        self.running.setdefault(endpoint, set()).add(transfer_id)
        self._send(endpoint, [transfer_id], "running", RUNNING_TTL_MS, "")

    def end(self, endpoint: str, transfer_id: str, *, ok: bool, reason: str = "") -> None:
        """The prefill of ``transfer_id`` ended: say ``done`` (or ``failed``, why)."""
        ids = self.running.get(endpoint)
        if ids is not None:
            ids.discard(transfer_id)
            if not ids:
                del self.running[endpoint]
        state = "done" if ok else "failed"
        self._send(endpoint, [transfer_id], state, FINAL_TTL_MS, reason[:400])

    async def run(self) -> None:
        """Say ``running`` for every waited-on transfer every ``heartbeat_s``, until cancelled."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                self.beat()
            except Exception:  # NOTE: a bug must not stop the words (D's loads would fail)
                logger.exception("early handoff: a round of words failed; going on")

    def beat(self) -> None:
        """One round of ``running`` words (one message per decoder and 1024
        transfers), and an empty one to each silent decoder waiting on none."""
        for endpoint in self.silent - set(self.running):
            self._send(endpoint, [], "running", RUNNING_TTL_MS, "")
        for endpoint, ids in self.running.items():
            listed = sorted(ids)
            for at in range(0, len(listed), MAX_IDS_PER_MESSAGE):
                batch = listed[at : at + MAX_IDS_PER_MESSAGE]
                self._send(endpoint, batch, "running", RUNNING_TTL_MS, "")

    async def close(self) -> None:
        """Wait for the words on their way (each is bounded by its call)."""
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)

    def _send(self, endpoint: str, ids: list[str], state: str, ttl_ms: int, reason: str) -> None:
        task = asyncio.create_task(self._say(endpoint, ids, state, ttl_ms, reason))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _say(
        self, endpoint: str, ids: list[str], state: str, ttl_ms: int, reason: str
    ) -> None:
        try:
            await self.call(endpoint, "prefill_state", ids, state, ttl_ms=ttl_ms, reason=reason)
        except PeerUnreachable as exc:
            # NOTE: D's loads then run out of word and fail (vLLM recomputes)
            self.failed_words += 1
            self.silent.add(endpoint)
            logger.debug(
                "prefill state %s of %d transfer(s) to %s: %s", state, len(ids), endpoint, exc
            )
        except FabricError as exc:
            self.failed_words += 1
            if endpoint not in self.refused:
                logger.warning(
                    "decoder at %s refused the early handoff's word (%s): it gets the "
                    "sequential flow until it restarts",
                    endpoint, exc,
                )  # fmt: skip
            self.refused[endpoint] = time.monotonic() + REFUSED_RETRY_S
        else:
            self.silent.discard(endpoint)
