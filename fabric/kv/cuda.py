"""Fused CUDA pack/unpack (``fabric/kv/csrc/``) behind :class:`fabric.kv.kernels.DeviceKernels`.

Which implementation copies a request's blocks (:func:`choose_implementation`)::

    cache device   fused extension   implementation
    cpu            (not asked)       fabric.kv._copy (C) or torch slice copies
    cuda           loaded            CudaKernels: one launch for every layer
    cuda           missing           TorchIndexKernels (one launch per row)
    other          (not asked)       TorchIndexKernels

The extension is ``fabric.kv._cuda_pack`` when built ahead of time (setup.py,
where the build imports a CUDA torch and finds the toolkit), else it is
compiled on first use with ``torch.utils.cpp_extension.load`` into
``~/.cache/fabric/torch_extensions/`` (only when CUDA is available; a failed
build logs a warning once and falls back to torch indexing).

Streams: :class:`CudaKernels` launches on a side stream per device that first
waits for the caller's current stream (so it sees the finished KV), then
records ``last_event``. The caller's current stream then waits on that event
on the device (no host block), so ``pack``/``unpack`` stay stream-ordered like
any torch op: ``dst.cpu()`` or attention after them see the copied bytes.
``CudaKernels(ext, join_current=False)`` skips that wait after ``pack`` so the
compute stream never waits on it; the caller must then wait on ``last_event``
itself. Either way the host returns before the copy ends: NIXL (which reads
outside CUDA stream order) may post a WRITE of a packed chunk only after
``last_event.synchronize()`` (or :meth:`CudaKernels.synchronize`), and the
request's blocks must stay held until then.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import numpy as np

from fabric.errors import LayoutError
from fabric.kv.kernels import DeviceKernels, TorchIndexKernels

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Implementation = Literal["cpu", "cuda-kernels", "torch-index"]

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
"""The kernels' sources, shipped in the package (an installed wheel can JIT-build them)."""
SOURCES = ("pack_binding.cpp", "pack_kernels.cu", "checksum_kernels.cu")
CUDA_FLAGS = ("-O3", "--expt-relaxed-constexpr")
AOT_MODULE = "fabric.kv._cuda_pack"
JIT_NAME = "fabric_cuda_pack"


def choose_implementation(device_type: str, extension_available: bool) -> Implementation:
    """Which copy path serves caches on ``device_type`` (see the module table)."""
    if device_type == "cpu":
        return "cpu"
    if device_type == "cuda" and extension_available:
        return "cuda-kernels"
    return "torch-index"


def kernels_for(
    device_type: str, load: Callable[[], ModuleType | None] | None = None
) -> DeviceKernels:
    """The :class:`DeviceKernels` for caches on ``device_type``.

    ``load`` returns the fused extension or None (default :func:`load_extension`);
    it is only called for CUDA caches. CUDA kernels are one shared instance per
    extension, so ``last_event`` is the event of the calling thread's latest launch.
    """
    extension = (load or load_extension)() if device_type == "cuda" else None
    if choose_implementation(device_type, extension is not None) == "cuda-kernels":
        assert extension is not None
        return _shared_kernels(extension)
    return TorchIndexKernels()


@functools.cache
def _shared_kernels(extension: ModuleType) -> CudaKernels:
    return CudaKernels(extension)


@functools.cache
def load_extension() -> ModuleType | None:
    """The fused pack/unpack extension, or None when it cannot be had."""
    import torch  # NOTE: first, so the extension finds libtorch's symbols loaded

    try:
        return importlib.import_module(AOT_MODULE)
    except ImportError:
        pass
    if not torch.cuda.is_available():
        return None
    try:
        return _build_extension()
    except Exception as exc:  # NOTE: any build failure means "use torch indexing"
        log.warning(
            "fabric CUDA pack kernels unavailable: no prebuilt %s (pip install "
            "--no-build-isolation with CUDA torch and the toolkit builds one) and the JIT "
            "build failed (%s; it needs nvcc, found through CUDA_HOME, and ninja); "
            "using torch indexing, one copy per layer",
            AOT_MODULE,
            exc,
        )
        return None


def build_directory() -> Path:
    """Where the JIT build lives: one folder per torch and CUDA version."""
    import torch

    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"torch{torch.__version__}-cuda{torch.version.cuda}")
    return Path.home() / ".cache" / "fabric" / "torch_extensions" / tag


def _build_extension() -> ModuleType:
    from torch.utils.cpp_extension import load

    sources = [CSRC_DIR / name for name in SOURCES]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"kernel sources not found: {missing}")
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    return load(
        name=JIT_NAME,
        sources=[str(s) for s in sources],
        extra_cflags=["-O3"],
        extra_cuda_cflags=list(CUDA_FLAGS),
        extra_include_paths=[str(CSRC_DIR)],
        build_directory=str(directory),
        verbose=False,
    )


def row_table(views: list[torch.Tensor]) -> tuple[list[int], list[int], int]:
    """(row base addresses, row block strides in bytes, segment bytes) of ``views``.

    ``views`` are the uint8 ``[num_blocks, segment_bytes]`` segment views of
    :func:`fabric.kv.pack.segment_views`, one per (layer, segment) row.
    """
    if not views:
        raise LayoutError("no segment views given")
    segment_bytes = int(views[0].shape[1])
    for view in views:
        if view.dim() != 2 or view.shape[1] != segment_bytes or view.stride(1) != 1:
            raise LayoutError(f"segment view {list(view.shape)} is not [blocks, {segment_bytes}]")
    bases = [int(v.data_ptr()) for v in views]
    strides = [int(v.stride(0)) * v.element_size() for v in views]
    return bases, strides, segment_bytes


def launch_table(views: list[torch.Tensor], ids: np.ndarray) -> tuple[torch.Tensor, int, int]:
    """One int64 host tensor ``[bases | strides | block ids]``, its row count, segment bytes.

    One tensor so the launch needs a single host-to-device copy.
    """
    import torch

    bases, strides, segment_bytes = row_table(views)
    table = torch.empty(2 * len(bases) + len(ids), dtype=torch.int64)
    table[: len(bases)] = torch.tensor(bases, dtype=torch.int64)
    table[len(bases) : 2 * len(bases)] = torch.tensor(strides, dtype=torch.int64)
    table[2 * len(bases) :] = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    return table, len(bases), segment_bytes


class CudaKernels:
    """Pack/unpack with the fused ``fabric/kv/csrc/`` kernels on a side stream.

    ``last_event`` is recorded after each launch (per calling thread); wait on
    it before anything outside CUDA stream order (NIXL) reads a packed chunk. With
    ``join_current`` (the default) the caller's current stream waits on it
    too; without, only ``unpack`` makes the current stream wait.
    """

    def __init__(self, extension: ModuleType, *, join_current: bool = True) -> None:
        self._extension = extension
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._streams_lock = threading.Lock()
        self.join_current = join_current
        # NOTE: per thread: the instance is shared (the pack thread packs
        # while the loader unpacks), and a thread must wait on its own
        # launch, not on another thread's that it may precede on the stream
        self._local = threading.local()

    @property
    def last_event(self) -> torch.cuda.Event | None:
        """The event recorded after this thread's latest launch (None before one)."""
        return getattr(self._local, "event", None)

    def pack(self, views: list[torch.Tensor], ids: np.ndarray, dst: torch.Tensor) -> None:
        """Gather blocks ``ids`` of every row into ``dst`` in one launch."""
        if dst.device != views[0].device:
            TorchIndexKernels().pack(views, ids, dst)
            return
        self._launch(self._extension.pack, views, ids, dst, after_unpack=False)

    def unpack(self, src: torch.Tensor, views: list[torch.Tensor], ids: np.ndarray) -> None:
        """Scatter ``src`` into blocks ``ids`` of every row in one launch."""
        if src.device != views[0].device:
            src = src.to(views[0].device, non_blocking=True)
        self._launch(self._extension.unpack, views, ids, src, after_unpack=True)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream this instance launches on for ``device``."""
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._streams_lock:
            if index not in self._streams:
                self._streams[index] = torch.cuda.Stream(device=index)
            return self._streams[index]

    def synchronize(self) -> None:
        """Block the host until this thread's latest launch has finished."""
        if self.last_event is not None:
            self.last_event.synchronize()

    def _launch(
        self,
        kernel: Callable[..., None],
        views: list[torch.Tensor],
        ids: np.ndarray,
        chunk: torch.Tensor,
        *,
        after_unpack: bool,
    ) -> None:
        import torch

        device = chunk.device
        host, rows, segment_bytes = launch_table(views, ids)
        current = torch.cuda.current_stream(device)
        side = self.side_stream(device)
        side.wait_stream(current)  # the KV (or chunk) was written on the current stream
        with torch.cuda.stream(side):
            # NOTE: pinned + non_blocking so the copy does not stall the host;
            # torch keeps the pinned block alive until the side stream used it.
            table = host.pin_memory().to(device, non_blocking=True)
            kernel(
                table[:rows],
                table[rows : 2 * rows],
                table[2 * rows :],
                chunk,
                segment_bytes,
                side.cuda_stream,
            )
            event = torch.cuda.Event()
            event.record(side)
        chunk.record_stream(side)  # chunk memory is not reused before the copy ends
        if after_unpack or self.join_current:
            current.wait_event(event)  # on the device: the host does not block
        self._local.event = event
