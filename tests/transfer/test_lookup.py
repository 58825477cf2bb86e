"""StoreClient and call_all against real ZMQ ROUTER sockets that answer,
stall (read and never answer), answer late, or are not there at all."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from fabric.errors import PeerUnreachable, SignatureError, TransferError
from fabric.launch.process import free_port
from fabric.transfer import protocol as proto
from fabric.transfer.lookup import (
    NoConnection,
    ReplyTimeout,
    StoreClient,
    call_all,
    lookup_all,
)

CHUNK_TOKENS = 4
TOKENS = list(range(16))


class FakeRank:
    """A ZMQ ROUTER standing in for a worker's control endpoint.

    ``hit``: the hit_chunks it answers every Lookup with; None: it reads
    each request and never answers (a stalled worker; ``answer_stalled``
    answers them later). ``before_answer`` runs (on its thread) before each
    answer, ``on_request`` as each request arrives."""

    def __init__(
        self,
        hit: int | None,
        *,
        secret: str | None = None,
        port: int | None = None,
        before_answer: Callable[[], object] | None = None,
        on_request: Callable[[], object] | None = None,
    ) -> None:
        self.hit = hit
        self.codec = proto.Codec(secret)
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.before_answer, self.on_request = before_answer, on_request
        self.requests: list[proto.Message] = []
        self._stalled: list[tuple[bytes, proto.Message]] = []
        self._commands: queue.Queue[tuple[int, threading.Event]] = queue.Queue()
        self._stop = threading.Event()
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def answer_stalled(self, hit: int) -> None:
        """Answer every request read so far and not answered, with ``hit``
        (returns once the answers are sent)."""
        done = threading.Event()
        self._commands.put((hit, done))
        assert done.wait(30), "the fake rank's thread is stuck"

    def request_ids(self) -> list[str]:
        """The request id of every request read so far (Lookups name their hold)."""
        return [getattr(m, "request_id", getattr(m, "transfer_id", "")) for m in self.requests]

    def wait_requests(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.requests) < n:
            assert time.monotonic() < deadline, f"{self.endpoint} got {len(self.requests)} < {n}"
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._sock.close(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            while not self._commands.empty():
                hit, done = self._commands.get()
                for identity, msg in self._stalled:
                    self._answer(identity, msg, hit)
                self._stalled.clear()
                done.set()
            if not self._sock.poll(5):
                continue
            identity, frame = self._sock.recv_multipart()
            try:
                msg = self.codec.decode(frame)
            except SignatureError as exc:  # as the real server answers it
                refused = proto.Refused(-1, "", "bad_signature", str(exc))
                self._sock.send_multipart([identity, self.codec.encode(refused)])
                continue
            self.requests.append(msg)
            if self.on_request is not None:
                self.on_request()
            if self.hit is None:
                self._stalled.append((identity, msg))
                continue
            if self.before_answer is not None:
                self.before_answer()
            self._answer(identity, msg, self.hit)

    def _answer(self, identity: bytes, msg: proto.Message, hit: int) -> None:
        seq = msg.seq  # type: ignore[union-attr]
        if isinstance(msg, proto.Fetch):
            reply: proto.Message = proto.Fetching(seq, msg.transfer_id, CHUNK_TOKENS, hit, hit > 0)
        else:
            assert isinstance(msg, proto.Lookup)
            reply = proto.LookupResult(seq, msg.request_id, CHUNK_TOKENS, hit, 0, hit > 0)
        self._sock.send_multipart([identity, self.codec.encode(reply)])


@pytest.fixture
def ranks() -> Iterator[Callable[..., FakeRank]]:
    started: list[FakeRank] = []

    def start(hit: int | None, **kw: object) -> FakeRank:
        rank = FakeRank(hit, **kw)  # type: ignore[arg-type]
        started.append(rank)
        return rank

    yield start
    for rank in started:
        rank.close()


def test_a_stalled_peer_is_a_timeout_while_the_other_answers(ranks) -> None:
    answering, stalled = ranks(3), ranks(None)
    a, b = StoreClient(answering.endpoint), StoreClient(stalled.endpoint)
    started = time.monotonic()
    results = lookup_all([a, b], TOKENS, hold="r1", timeout_ms=300)
    assert time.monotonic() - started >= 0.3  # it did wait for the stalled one
    ok, late = results
    assert isinstance(ok, proto.LookupResult) and ok.hit_chunks == 3
    assert isinstance(late, ReplyTimeout) and "no answer to Lookup in 300 ms" in str(late)
    stalled.wait_requests(1)  # it was sent: the peer read it
    a.close()
    b.close()


def test_every_peer_is_asked_before_any_answer_is_awaited(ranks) -> None:
    """The first peer answers only once the second got its request: asked
    one after the other, the first would time out."""
    second_asked = threading.Event()
    first = ranks(2, before_answer=lambda: second_asked.wait(30))
    second = ranks(2, on_request=second_asked.set)
    clients = [StoreClient(first.endpoint), StoreClient(second.endpoint)]
    results = lookup_all(clients, TOKENS, timeout_ms=10_000)
    assert [getattr(r, "hit_chunks", r) for r in results] == [2, 2]
    for client in clients:
        client.close()


def test_a_late_reply_is_never_taken_for_the_next_answer(ranks) -> None:
    rank = ranks(None)
    client = StoreClient(rank.endpoint, timeout_ms=200)
    with pytest.raises(ReplyTimeout):
        client.lookup(TOKENS, hold="r1")
    rank.answer_stalled(99)  # the answer to r1, after r1 gave up
    with pytest.raises(ReplyTimeout):  # r2's own answer never comes: 99 is not it
        client.lookup(TOKENS, hold="r2")
    rank.wait_requests(2)
    rank.hit = 1  # it answers again
    assert client.lookup(TOKENS, hold="r3").hit_chunks == 1
    rank.answer_stalled(77)  # r2's late answer, now with r4 in flight
    assert client.lookup(TOKENS, hold="r4").hit_chunks == 1
    client.close()


def test_nothing_listening_is_no_connection_and_nothing_waits_to_be_sent() -> None:
    port = free_port()
    client = StoreClient(f"tcp://127.0.0.1:{port}", timeout_ms=200)
    with pytest.raises(NoConnection, match="no connection took Lookup in 200 ms"):
        client.lookup(TOKENS, hold="r1")
    assert issubclass(NoConnection, PeerUnreachable)
    late = FakeRank(5, port=port)  # the worker comes up afterwards
    try:
        deadline = time.monotonic() + 30
        while True:  # NOTE: ZMQ reconnects on its own schedule
            try:
                assert client.lookup(TOKENS, hold="r2").hit_chunks == 5
                break
            except NoConnection:
                assert time.monotonic() < deadline, "never reconnected"
        # r1 was never queued for the absent peer: it only ever saw r2
        assert late.request_ids() == ["r2"]
    finally:
        late.close()
        client.close()


def test_a_secret_mismatch_is_a_transfer_error_not_a_timeout(ranks) -> None:
    rank = ranks(2, secret="theirs")
    client = StoreClient(rank.endpoint, secret="ours", timeout_ms=10_000)
    with pytest.raises(TransferError) as info:
        client.lookup(TOKENS)
    assert not isinstance(info.value, PeerUnreachable)
    client.close()


def test_call_all_reports_each_failure_without_failing_the_others(ranks) -> None:
    answering = ranks(4)
    absent = StoreClient(f"tcp://127.0.0.1:{free_port()}")
    present = StoreClient(answering.endpoint)
    calls = [
        (absent, absent.lookup_message(TOKENS)),
        (present, present.lookup_message(TOKENS)),
    ]
    missing, ok = call_all(calls, timeout_ms=200)
    assert isinstance(missing, NoConnection)
    assert isinstance(ok, proto.LookupResult) and ok.hit_chunks == 4
    absent.close()
    present.close()
