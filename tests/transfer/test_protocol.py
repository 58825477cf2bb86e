from __future__ import annotations

import struct

import pytest

from fabric.errors import ProtocolError
from fabric.transfer import protocol as proto

MESSAGES = [
    proto.Hello(1, "agent-a", "nixl", "f" * 64, b"\x00meta"),
    proto.HelloAck(1, "agent-b", "tcp", "f" * 64, b"desc", 4096, 16),
    proto.Reserve(2, "req-1", [b"k" * 16, b"j" * 16], [4096, 100], 10_000),
    proto.Reserved(2, "req-1", [3, 4], [0, 7], [False, True], 10_000),
    proto.Refused(3, "req-1", "capacity", "pool full"),
    proto.Cancel(4, "req-1"),
    proto.Heartbeat(5, "req-1", 5000),
    proto.Ack(5, "req-1", True),
    proto.WriteDone("req-1", [0, 1], [2, 3], [2**64 - 1, 0]),
    proto.WritePart("req-1", 3, 2, 16),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: proto.Message) -> None:
    assert proto.decode(proto.encode(msg)) == msg


def test_frame_starts_with_magic_and_version() -> None:
    frame = proto.encode(proto.Cancel(1, "r"))
    assert frame[:2] == proto.MAGIC
    assert struct.unpack_from("<H", frame, 2)[0] == proto.PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "shorter than its header"),
        (b"F", "shorter than its header"),
        (b"XX\x01\x00abc", "bad magic"),
        (b"FB\x63\x00" + proto.encode(proto.Cancel(1, "r"))[4:], "protocol version 99"),
        (b"FB\x01\x00\xc1\xc1\xc1", "undecodable"),
        (proto.encode(proto.Cancel(1, "r"))[:-2], "undecodable"),
        (b"FB\x01\x00" + b"\x92\xa7unknown\x01", "undecodable"),
    ],
)
def test_bad_frames_are_refused(frame: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        proto.decode(frame)


def test_oversized_frame_is_refused_before_decoding() -> None:
    frame = proto.encode(proto.Reserve(1, "r", [b"k" * 16] * 1000, [1] * 1000, 1))
    with pytest.raises(ProtocolError, match="exceeds limit"):
        proto.decode(frame, max_bytes=1024)


def test_wrong_field_types_are_refused() -> None:
    frame = b"FB\x01\x00" + proto._encoder.encode(["cancel", "not-an-int", "r"])
    with pytest.raises(ProtocolError, match="undecodable"):
        proto.decode(frame)
