"""LayerwiseUnpack: a chunk unpacked a layer group at a time, hashed as it is copied."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import xxhash

from fabric.errors import LayoutError
from fabric.kv import KVLayout, LayoutKind, backend, pack, unpack
from fabric.kv import verify as kv_verify
from fabric.kv.layerwise import LayerwiseUnpack, group_ends, layer_bytes

MakeCaches = Callable[..., list[torch.Tensor]]
KINDS = [LayoutKind.CPU, LayoutKind.FLASH, LayoutKind.MLA]
SRC_IDS = [7, 2, 3, 4, 0, 11]

pytestmark = pytest.mark.skipif(backend() != "c", reason="layer-wise unpacking needs the C kernel")


@pytest.fixture(params=[1000, kv_verify.PIECE_BYTES], ids=["small-pieces", "default-pieces"])
def piece(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(kv_verify, "PIECE_BYTES", request.param)
    return int(request.param)


def raw(tensors: list[torch.Tensor]) -> list[bytes]:
    return [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("groups", [1, 2, 5])
@pytest.mark.parametrize(
    ("first", "count"), [(0, 6), (2, 3), (5, 1)], ids=["whole", "first=2", "last-block"]
)
def test_group_by_group_equals_a_verified_unpack(
    make_caches: MakeCaches, piece: int, kind: LayoutKind, groups: int, first: int, count: int
) -> None:
    caches = make_caches(kind, num_layers=5)
    layout = KVLayout.from_tensors(caches)
    spare = 333
    slot = torch.full((layout.chunk_nbytes(len(SRC_IDS)) + spare,), 0x5A, dtype=torch.uint8)
    pack(caches, layout, SRC_IDS, slot)
    nbytes = layout.chunk_nbytes(len(SRC_IDS)) + 100  # the checksum covers bytes past the chunk
    want = xxhash.xxh3_64_intdigest(slot[:nbytes].numpy())
    dst_ids = [1, 8, 9, 10, 5, 6][:count]
    whole = [torch.zeros_like(c) for c in caches]
    unpack(slot, whole, layout, dst_ids, chunk_blocks=len(SRC_IDS), first=first)
    layered = [torch.zeros_like(c) for c in caches]
    part = LayerwiseUnpack(
        slot, layered, layout, dst_ids, chunk_blocks=len(SRC_IDS), first=first, nbytes=nbytes
    )
    for end in group_ends(layout.num_layers, groups):
        part.unpack_layers(end)
        part.unpack_layers(end)  # NOTE: again: a no-op
        assert part.layers_done == end
    assert part.finish() == want
    assert raw(layered) == raw(whole)


def test_a_layer_changed_after_it_was_unpacked_changes_the_digest(
    make_caches: MakeCaches,
) -> None:
    """The digest is of the bytes read as they were copied: a group rewritten
    before it is read fails; one rewritten after it was read leaves the
    blocks holding what was hashed."""
    caches = make_caches(LayoutKind.CPU, num_layers=4)
    layout = KVLayout.from_tensors(caches)
    slot = torch.zeros(layout.chunk_nbytes(len(SRC_IDS)), dtype=torch.uint8)
    pack(caches, layout, SRC_IDS, slot)
    want = xxhash.xxh3_64_intdigest(slot.numpy())
    per_layer = layer_bytes(layout, len(SRC_IDS))
    dst = [torch.zeros_like(c) for c in caches]
    part = LayerwiseUnpack(
        slot, dst, layout, SRC_IDS, chunk_blocks=len(SRC_IDS), first=0, nbytes=slot.numel()
    )
    part.unpack_layers(2)
    slot[3 * per_layer + 5] ^= 0xFF  # a layer not read yet
    assert part.finish() != want


def test_bad_arguments_are_refused(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.CPU, num_layers=2)
    layout = KVLayout.from_tensors(caches)
    slot = torch.zeros(layout.chunk_nbytes(len(SRC_IDS)), dtype=torch.uint8)
    with pytest.raises(LayoutError):
        LayerwiseUnpack(
            slot, caches, layout, [1, 2], chunk_blocks=len(SRC_IDS), first=5, nbytes=slot.numel()
        )
    with pytest.raises(LayoutError):
        LayerwiseUnpack(
            slot, caches, layout, [1], chunk_blocks=len(SRC_IDS), first=0, nbytes=slot.numel() + 1
        )
    part = LayerwiseUnpack(
        slot, caches, layout, [1], chunk_blocks=len(SRC_IDS), first=0, nbytes=slot.numel()
    )
    with pytest.raises(LayoutError):
        part.unpack_layers(3)
