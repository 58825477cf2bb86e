"""pack/unpack runtime behaviour: GIL release, fallback, light import, devices."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from fabric.kv import KVLayout, LayoutKind, backend, pack, unpack

# NOTE: the attribute fabric.kv.pack is the re-exported function, which shadows
# the submodule for `import fabric.kv.pack as m`; fetch the module itself.
pack_module = importlib.import_module("fabric.kv.pack")

MakeCaches = Callable[..., list[torch.Tensor]]
needs_c = pytest.mark.skipif(backend() != "c", reason="fabric.kv._copy is not built")


def test_import_does_not_load_torch() -> None:
    code = "import sys, fabric.kv; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@needs_c
def test_copy_batch_releases_the_gil() -> None:
    from fabric.kv import _copy  # type: ignore[attr-defined]

    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    repeats = 24  # ~1.5 GiB of copying: well over 100 ms
    args = [np.full(repeats, a.ctypes.data, dtype=np.int64) for a in (dst, src)]
    lengths = np.full(repeats, src.nbytes, dtype=np.int64)
    started, gaps = threading.Event(), [0.0]

    def copy() -> None:
        started.set()
        _copy.copy_batch(args[0], args[1], lengths, 1)

    worker = threading.Thread(target=copy)
    worker.start()
    started.wait()
    begin = last = time.perf_counter()
    while worker.is_alive():
        now = time.perf_counter()
        gaps[0], last = max(gaps[0], now - last), now
    worker.join()
    took = time.perf_counter() - begin
    # Holding the GIL would stall this loop for the whole copy.
    assert took > 0.05
    assert gaps[0] < took / 2, f"main thread stalled {gaps[0]:.3f}s of {took:.3f}s"


def test_fallback_when_extension_is_missing(
    make_caches: MakeCaches, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caches = make_caches(LayoutKind.FLASH, torch.float16)
    layout = KVLayout.from_tensors(caches)
    expected = torch.empty(layout.chunk_nbytes(3), dtype=torch.uint8)
    pack(caches, layout, [4, 5, 1], expected)
    monkeypatch.setattr(pack_module, "_copy", None)
    pack_module._warn_fallback.cache_clear()
    assert backend() == "torch"
    chunk = torch.empty_like(expected)
    with caplog.at_level(logging.WARNING, logger="fabric.kv.pack"):
        pack(caches, layout, [4, 5, 1], chunk)
        unpack(chunk, [torch.zeros_like(t) for t in caches], layout, [4, 5, 1])
    assert torch.equal(chunk, expected)
    assert [r.message for r in caplog.records].count(
        "fabric.kv._copy is not built; packing KV with slower torch copies"
    ) == 1
    with pytest.raises(Exception, match="backend 'c' requested"):
        pack(caches, layout, [1], chunk, backend="c")
    pack_module._warn_fallback.cache_clear()


def test_cpu_cache_refuses_device_buffer(make_caches: MakeCaches) -> None:
    caches = make_caches(LayoutKind.MLA)
    layout = KVLayout.from_tensors(caches)
    meta = torch.empty(layout.chunk_nbytes(1), dtype=torch.uint8, device="meta")
    with pytest.raises(Exception, match="dst is on meta but the KV cache is on the CPU"):
        pack(caches, layout, [0], meta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", list(LayoutKind), ids=lambda k: k.value)
def test_cuda_matches_cpu(make_caches: MakeCaches, kind: LayoutKind) -> None:
    caches = make_caches(kind, torch.bfloat16)
    layout = KVLayout.from_tensors(caches)
    ids = [7, 2, 3, 0]
    expected = torch.empty(layout.chunk_nbytes(len(ids)), dtype=torch.uint8)
    pack(caches, layout, ids, expected)
    on_gpu = [t.cuda() for t in caches]
    for dst in (torch.empty_like(expected), torch.empty_like(expected, device="cuda")):
        pack(on_gpu, layout, ids, dst)
        assert torch.equal(dst.cpu(), expected)
    fresh = [torch.zeros_like(t) for t in on_gpu]
    unpack(expected, fresh, layout, ids)
    chunk = torch.empty_like(expected, device="cuda")
    pack(fresh, layout, ids, chunk)
    assert torch.equal(chunk.cpu(), expected)
