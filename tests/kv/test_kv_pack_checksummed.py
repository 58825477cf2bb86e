"""pack_checksummed: the checksum taken as the copy reads equals the hash of what it wrote."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
import xxhash

from fabric.kv import KVLayout, LayoutKind, backend, pack, pack_checksummed
from fabric.kv import verify as kv_verify

MakeCaches = Callable[..., list[torch.Tensor]]
KINDS = [LayoutKind.CPU, LayoutKind.FLASH, LayoutKind.MLA]

pytestmark = pytest.mark.skipif(backend() != "c", reason="the fused path is the C backend's")


@pytest.fixture(params=["fused", "pack-then-hash"], autouse=True)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways pack_checksummed goes (by the mean copy size)."""
    pack_module = importlib.import_module("fabric.kv.pack")
    minimum = 0 if request.param == "fused" else 1 << 62
    monkeypatch.setattr(pack_module, "FUSED_MIN_COPY_BYTES", minimum)
    return str(request.param)


@pytest.mark.parametrize("pieces", [1000, None], ids=["small-pieces", "default-pieces"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("ids", [[7, 2, 3, 4, 0, 11], [5], [0, 1, 2, 3]])
def test_the_checksum_is_the_hash_of_the_bytes_pack_writes(
    make_caches: MakeCaches,
    kind: LayoutKind,
    ids: list[int],
    pieces: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layout, unordered ids with a run among single blocks, pieces
    that cut copies mid-block: the same bytes as ``pack``, and their xxh3-64."""
    if pieces is not None:
        monkeypatch.setattr(kv_verify, "PIECE_BYTES", pieces)
    caches = make_caches(kind)
    layout = KVLayout.from_tensors(caches)
    nbytes = layout.chunk_nbytes(len(ids))
    want = torch.full((nbytes + 64,), 0x5A, dtype=torch.uint8)
    pack(caches, layout, ids, want)
    got = torch.full((nbytes + 64,), 0x5A, dtype=torch.uint8)
    written, checksum = pack_checksummed(caches, layout, ids, got)
    assert written == nbytes
    assert torch.equal(got, want)  # NOTE: the spare bytes after the chunk untouched too
    assert checksum == xxhash.xxh3_64_intdigest(want[:nbytes].numpy())


def test_a_source_changed_between_its_copy_and_its_hash_fails_the_checksum(
    make_caches: MakeCaches, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A writer racing the pack (vLLM reusing a block too early) that lands
    after the copy read a piece and before its hash: the checksum is the
    source's, so the written bytes fail it at use (pack-then-hash passes
    them). One that lands before the copy reads the piece is not seen by
    either: the hook order keeps writers out (``test_vllm_hook_order``)."""
    pack_module = importlib.import_module("fabric.kv.pack")  # NOTE: fabric.kv.pack is the function

    caches = make_caches(LayoutKind.CPU)
    layout = KVLayout.from_tensors(caches)
    ids = [1, 2]
    real = pack_module._copy.copy_batch
    calls = []

    def copy_then_scribble(*args: object, **kw: object) -> None:
        real(*args, **kw)
        calls.append(1)
        if len(calls) == 1:
            caches[0][1].view(torch.uint8).view(-1)[:16] ^= 0xFF  # the first bytes copied

    class Shim:
        copy_batch = staticmethod(copy_then_scribble)

    monkeypatch.setattr(pack_module, "_copy", Shim)
    monkeypatch.setattr(pack_module, "_stream_kwargs", lambda: {})
    dst = torch.zeros(layout.chunk_nbytes(len(ids)), dtype=torch.uint8)
    nbytes, checksum = pack_checksummed(caches, layout, ids, dst)
    hashed = xxhash.xxh3_64_intdigest(dst[:nbytes].numpy())
    if path == "fused":
        assert checksum != hashed
    else:  # NOTE: what pack-then-hash cannot see: the torn copy passes
        assert checksum == hashed
