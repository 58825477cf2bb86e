"""The control port of a fake decoder (:mod:`fabric.testing.fake_engine`, ``serve_kv``).

It speaks the fabric control protocol as far as the proxy uses it with a
decoder: ``PrefillState`` (the early handoff's word, recorded and answered
``Done``, with the server's rules: ``done`` and ``failed`` final) and
``Stats`` (the health probe's ``threads_down``: 0). Anything else is
refused, and with ``refuse_words`` so is ``PrefillState`` (as a fabric
decoder without early handoff answers it). :meth:`FakeKvPort.wait_prefill`
is what a fabric decoder's loader does with the word: wait while the prefill is said running, end on
``done`` or ``failed``, or when the word runs out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import zmq

from fabric.errors import ProtocolError
from fabric.transfer import protocol as proto


@dataclass(frozen=True)
class Word:
    """The last word on one transfer."""

    state: str
    until: float  # monotonic: when a ``running`` runs out
    reason: str


class FakeKvPort:
    """A ZMQ ROUTER on ``endpoint`` (tcp://host:port), served by a thread."""

    def __init__(self, endpoint: str, *, refuse_words: bool = False) -> None:
        self.refuse_words = refuse_words
        self.codec = proto.Codec()
        self.words: dict[str, Word] = {}
        self.said: list[tuple[str, str]] = []  # (transfer, state) in the order received
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._thread = threading.Thread(target=self._run, name="fake-kv-port", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)

    def word(self, transfer_id: str) -> Word | None:
        with self._lock:
            return self.words.get(transfer_id)

    async def wait_prefill(self, transfer_id: str, timeout_s: float, grace_s: float = 2.0) -> str:
        """``done``, ``failed: <reason>``, ``ran out`` (running, then silence)
        or ``no word`` (nothing within ``grace_s``); at most ``timeout_s``."""
        started = time.monotonic()
        deadline = started + timeout_s
        while (now := time.monotonic()) < deadline:
            word = self.word(transfer_id)
            if word is None and now - started > grace_s:
                return "no word"
            if word is not None and word.state == "done":
                return "done"
            if word is not None and word.state == "failed":
                return f"failed: {word.reason}"
            if word is not None and now > word.until:
                return "ran out"
            await asyncio.sleep(0.01)
        return "timeout"

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            identity, frame = self._sock.recv_multipart()
            reply = self._answer(frame)
            self._sock.send_multipart([identity, self.codec.encode(reply)])

    def _answer(self, frame: bytes) -> proto.Message:
        try:
            msg = self.codec.decode(frame)
        except ProtocolError as exc:
            return proto.Refused(-1, "", proto.Refusal.BAD_MESSAGE, str(exc))
        if isinstance(msg, proto.Stats):
            return proto.StatsReply(msg.seq, {"threads_down": 0})
        if not isinstance(msg, proto.PrefillState) or self.refuse_words:
            return proto.Refused(
                getattr(msg, "seq", -1), "", proto.Refusal.BAD_MESSAGE, "fake: not served"
            )
        recorded = 0
        until = time.monotonic() + msg.ttl_ms / 1000
        with self._lock:
            for rid in msg.request_ids:
                self.said.append((rid, msg.state))
                old = self.words.get(rid)
                if old is not None and old.state != "running":
                    continue
                self.words[rid] = Word(msg.state, until, msg.reason)
                recorded += 1
        return proto.Done(msg.seq, recorded)
