"""Key identity: what besides token ids a chunk key commits to."""

from __future__ import annotations

import pytest

from fabric.errors import ProtocolError
from fabric.kv import chunk_keys
from fabric.kv.identity import BASE, KeyIdentity

FP = "f" * 64
CT = 256
TOKENS = list(range(1000, 1000 + 4 * CT + 10))


def keys(identity: KeyIdentity = BASE, tokens: list[int] = TOKENS) -> list[bytes]:
    return chunk_keys(tokens, CT, FP, identity=identity)


def test_empty_identity_gives_the_keys_of_earlier_releases() -> None:
    assert keys(KeyIdentity()) == chunk_keys(TOKENS, CT, FP)
    assert KeyIdentity().encode() == b""


@pytest.mark.parametrize(
    "identity",
    [
        KeyIdentity(cache_salt="tenant-A"),
        KeyIdentity(lora="loraA:abc"),
        KeyIdentity(lora="loraA:abd"),  # same name, other adapter files
    ],
)
def test_salt_and_adapter_change_every_key(identity: KeyIdentity) -> None:
    base, other = keys(), keys(identity)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_two_salts_and_two_adapters_never_share_a_key() -> None:
    variants = [
        KeyIdentity(cache_salt="A"),
        KeyIdentity(cache_salt="B"),
        KeyIdentity(lora="x:1"),
        KeyIdentity(lora="x:1", cache_salt="A"),
        # NOTE: the parts are length-prefixed: ("ab", "") and ("a", "b") differ
        KeyIdentity(lora="ab"),
        KeyIdentity(lora="a", cache_salt="b"),
    ]
    seen = [set(keys(v)) for v in variants]
    for i, a in enumerate(seen):
        for b in seen[i + 1 :]:
            assert not a & b


def test_a_multimodal_item_changes_keys_from_its_chunk_on() -> None:
    image = KeyIdentity(mm=(("img-hash-1", 2 * CT + 10, 100),))
    other = KeyIdentity(mm=(("img-hash-2", 2 * CT + 10, 100),))
    base, a, b = keys(), keys(image), keys(other)
    assert a[:2] == base[:2]  # the text before the image is still shared
    assert all(x != y for x, y in zip(a[2:], base[2:], strict=True))
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_an_item_spanning_a_chunk_boundary_enters_both_chunks() -> None:
    spanning = KeyIdentity(mm=(("img", CT - 5, 10),))
    assert keys(spanning)[0] != keys()[0]
    moved = KeyIdentity(mm=(("img", CT - 4, 10),))  # same chunks, other position
    assert keys(spanning)[0] != keys(moved)[0]


def test_wire_form_round_trips() -> None:
    identity = KeyIdentity("lora:1", "salt", (("a", 1, 2), ("b", 300, 4)))
    assert KeyIdentity.decode(identity.encode()) == identity
    assert KeyIdentity.decode(b"") == BASE


@pytest.mark.parametrize(
    "data",
    [b"\xff\x00", b"\x93\x01\x02\x03", KeyIdentity(mm=(("a", -1, 2),)).encode(), b"x" * 70_000],
)
def test_malformed_wire_identity_is_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        KeyIdentity.decode(data)
