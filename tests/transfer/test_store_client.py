"""StoreClient and call_all against real ZMQ ROUTER sockets that answer,
stall (read and never answer), answer late, or are not there at all.

A client is warmed (connected, with a call on a long bound) before a test
needs an answer within a short one: a fresh connection takes what it takes
on a busy box, and that is not what these tests are about.
"""

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
from fabric.transfer.store_client import (
    SOCKET_HWM,
    NoConnection,
    PeerBusy,
    ReplyTimeout,
    StoreClient,
    call_all,
    lookup_all,
    wait_ready,
)

CHUNK_TOKENS = 4
TOKENS = list(range(16))


class FakeRank:
    """A ZMQ ROUTER standing in for a worker's control endpoint.

    ``hit``: the hit_chunks it answers every Lookup with; None: it reads
    each request and never answers (a stalled worker; ``answer_stalled``
    answers them later); ``stalls``: which requests it so stalls on, when
    not all; ``busy``: how many requests it first refuses as busy (its
    queue full, as the real server does). ``before_answer`` runs (on its thread) before each answer,
    ``on_request`` as each request arrives."""

    def __init__(
        self,
        hit: int | None,
        *,
        secret: str | None = None,
        port: int | None = None,
        before_answer: Callable[[], object] | None = None,
        on_request: Callable[[], object] | None = None,
        stalls: Callable[[proto.Message], bool] | None = None,
        busy: int = 0,
    ) -> None:
        self.hit, self.stalls, self.busy = hit, stalls, busy
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
            if self.busy:
                self.busy -= 1
                seq = msg.seq  # type: ignore[union-attr]
                busy = proto.Refused(seq, "", "busy", "offload queue full")
                self._sock.send_multipart([identity, self.codec.encode(busy)])
                continue
            if self.hit is None or (self.stalls is not None and self.stalls(msg)):
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


def warm(client: StoreClient, rank: FakeRank) -> None:
    """Connect ``client`` with one answered call on a long bound, then
    forget that call on the rank's side."""
    hit, rank.hit = rank.hit, 0
    try:
        [reply] = call_all([(client, client.lookup_message(TOKENS))], timeout_ms=30_000)
        assert isinstance(reply, proto.LookupResult), reply
    finally:
        rank.hit = hit
    rank.requests.clear()


def post(client: StoreClient, msg: proto.Message) -> None:
    """Post ``msg`` once a connection takes it."""
    deadline = time.monotonic() + 30
    while not client.post(msg):
        assert time.monotonic() < deadline, "never connected"
        wait_ready([], 10, [client])


def take(client: StoreClient, seq: int) -> proto.Message | Exception:
    deadline = time.monotonic() + 30
    while (reply := client.take_reply(seq)) is None:
        assert time.monotonic() < deadline, f"no reply to {seq}"
        wait_ready([client], 10)
    return reply


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
    warm(a, answering)
    warm(b, stalled)
    started = time.monotonic()
    results = lookup_all([a, b], TOKENS, hold="r1", timeout_ms=1000)
    assert time.monotonic() - started >= 1.0  # it did wait for the stalled one
    ok, late = results
    assert isinstance(ok, proto.LookupResult) and ok.hit_chunks == 3
    assert isinstance(late, ReplyTimeout) and "no answer to Lookup in 1000 ms" in str(late)
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
    warm(client, rank)
    with pytest.raises(ReplyTimeout):
        client.lookup(TOKENS, hold="r1")
    rank.answer_stalled(99)  # the answer to r1, after r1 gave up
    with pytest.raises(ReplyTimeout):  # r2's own answer never comes: 99 is not it
        client.lookup(TOKENS, hold="r2")
    rank.wait_requests(2)
    rank.hit = 1  # it answers again
    client.timeout_ms = 30_000  # NOTE: from here on every call is answered
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
    warm(present, answering)
    calls = [
        (absent, absent.lookup_message(TOKENS)),
        (present, present.lookup_message(TOKENS)),
    ]
    missing, ok = call_all(calls, timeout_ms=1000)
    assert isinstance(missing, NoConnection)
    assert isinstance(ok, proto.LookupResult) and ok.hit_chunks == 4
    absent.close()
    present.close()


def test_a_busy_refusal_says_ask_again(ranks) -> None:
    rank = ranks(2, busy=1)  # its queue is full for the first request
    client = StoreClient(rank.endpoint, timeout_ms=30_000)
    with pytest.raises(PeerBusy, match="refused: busy"):
        client.lookup(TOKENS)
    assert client.lookup(TOKENS).hit_chunks == 2  # nothing was done: asked again
    client.close()


# ---------------------------------------------------------------- in flight across calls
def test_requests_in_flight_on_one_socket_each_get_their_own_answer(ranks) -> None:
    rank = ranks(None)
    client = StoreClient(rank.endpoint)
    msgs = [client.lookup_message(TOKENS, hold=rid) for rid in ("a", "b", "c")]
    for msg in msgs:
        post(client, msg)
    rank.wait_requests(3)
    assert client.in_flight() == 3
    assert client.take_reply(msgs[0].seq) is None  # not answered yet
    client.forget(msgs[2].seq)  # c was given up on
    rank.answer_stalled(2)
    b = take(client, msgs[1].seq)  # taken out of order: each by its seq
    a = take(client, msgs[0].seq)
    assert isinstance(a, proto.LookupResult) and a.request_id == "a"
    assert isinstance(b, proto.LookupResult) and b.request_id == "b"
    assert client.take_reply(msgs[2].seq) is None  # c's answer was dropped
    assert client.in_flight() == 0
    client.close()


def test_a_call_in_between_leaves_the_answers_of_posted_requests(ranks) -> None:
    """call_all reads every reply queued; one for a posted request is kept."""
    rank = ranks(None)
    client = StoreClient(rank.endpoint, timeout_ms=30_000)
    posted = client.lookup_message(TOKENS, hold="posted")
    post(client, posted)
    rank.wait_requests(1)
    rank.answer_stalled(3)  # the posted request's answer...
    rank.hit = 1
    assert client.lookup(TOKENS, hold="call").hit_chunks == 1  # ...read during this call
    reply = take(client, posted.seq)
    assert isinstance(reply, proto.LookupResult) and reply.hit_chunks == 3
    client.close()


def test_a_refusal_answers_the_request_it_names_or_the_oldest(ranks) -> None:
    rank = ranks(2, secret="theirs")  # refuses our signature with seq -1
    client = StoreClient(rank.endpoint, secret="ours")
    first, second = client.lookup_message(TOKENS), client.lookup_message(TOKENS)
    post(client, first)
    post(client, second)
    assert "same transfer secret" in str(take(client, first.seq))
    assert isinstance(take(client, second.seq), TransferError)
    client.close()


def test_nothing_is_posted_without_a_connection_and_queues_are_small() -> None:
    client = StoreClient(f"tcp://127.0.0.1:{free_port()}")
    assert not client.post(client.lookup_message(TOKENS))  # nothing listens: not queued
    assert client.in_flight() == 0
    sock = client._sock
    assert sock is not None
    assert sock.getsockopt(zmq.SNDHWM) == sock.getsockopt(zmq.RCVHWM) == SOCKET_HWM <= 16
    assert sock.getsockopt(zmq.LINGER) == 0 and sock.getsockopt(zmq.IMMEDIATE) == 1
    client.close()


def test_closing_drops_what_was_in_flight(ranks) -> None:
    rank = ranks(None)
    client = StoreClient(rank.endpoint)
    msg = client.lookup_message(TOKENS, hold="r1")
    post(client, msg)
    rank.wait_requests(1)
    client.close()
    assert client.in_flight() == 0
    rank.answer_stalled(2)  # to a socket that is gone
    assert client.take_reply(msg.seq) is None
    client.close()
