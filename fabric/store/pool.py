"""The chunk pool: one registered memory region cut into fixed-size slots.

The transfer layer registers :attr:`ChunkPool.buffer` with NIXL exactly once,
so the region is allocated once, at construction, and never reallocated or
resized; everything else hands out views into it::

    base_address (4096-aligned)
    |
    v
    +-----------+-----------+-----------+-- ... --+-----------+
    |  slot 0   |  slot 1   |  slot 2   |         | slot N-1  |
    +-----------+-----------+-----------+-- ... --+-----------+
    |<-------->| slot_bytes
    |<------------------- nbytes = N * slot_bytes ----------->|

    slot_offset(s) = s * slot_bytes        (relative to base_address)

Where the region lives (``device``)::

    device     memory                          NIXL kind   checksum
    cpu        pageable host memory            DRAM        xxh3   (fabric.store.checksum)
    pinned     page-locked host memory (CUDA)  DRAM        xxh3
    cuda[:N]   VRAM of GPU N                   VRAM        fold64 (fabric.kv.fold64)

:meth:`ChunkPool.checksum` hashes a slot with the pool's own algorithm, on the
host for host pools and on the GPU for a VRAM pool (no device-to-host copy of
the chunk). :meth:`ChunkPool.memoryview` exists for host pools only; code that
must see a VRAM chunk's bytes on the host (the disk tier) stages them through
:meth:`ChunkPool.staging_buffer`, pinned host memory.
"""

from __future__ import annotations

import builtins
import weakref
from typing import TYPE_CHECKING, Any, Literal

from fabric.errors import ConfigError
from fabric.store.checksum import checksum as compute_checksum

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGNMENT", "HOST_DEVICES", "ChunkPool", "check_device", "resolve_pool_device"]

ALIGNMENT = 4096
"""Byte alignment of :attr:`ChunkPool.base_address` (one page)."""

HOST_DEVICES = ("cpu", "pinned")


def check_device(device: str) -> str:
    """``device`` if it names a pool device (cpu, pinned, cuda, cuda:N), else ConfigError."""
    if device in HOST_DEVICES or device == "cuda":
        return device
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        return device
    raise ConfigError(
        f"device: {device!r} is not a pool device (expected cpu, pinned, cuda or cuda:N)"
    )


def resolve_pool_device(
    requested: str, cache_devices: set[str], host_only: str | None = None
) -> str:
    """The pool device a connector's ``pool_device`` stands for.

    ``cache_devices``: where the KV cache's tensors are (``{"cuda:0"}``,
    ``{"cpu"}``). ``host_only``: why this engine's pool must be host memory
    (the TCP transport, a shared store), or None. ``auto`` is VRAM on the
    cache's GPU unless ``host_only`` (then pinned host memory), and the host
    for a CPU cache; ``host`` is host memory either way (pinned for a cache
    on a GPU); ``cuda`` asks for VRAM and is a ConfigError where it cannot
    be had.
    """
    if requested in HOST_DEVICES:
        return requested
    gpus = sorted(d for d in cache_devices if d.startswith("cuda"))
    if requested not in ("auto", "host", "cuda"):
        raise ConfigError(
            f"pool_device: {requested!r} is not one of auto, host, cuda, pinned or cpu"
        )
    if requested == "host":
        return "pinned" if gpus else "cpu"
    if not gpus or len(cache_devices) != 1:  # NOTE: not on exactly one GPU
        if requested == "cuda":
            where = ", ".join(sorted(cache_devices)) or "nowhere"
            raise ConfigError(
                f"pool_device: 'cuda' needs the KV cache on one GPU; it is on {where}"
            )
        return "cpu"
    if host_only is not None:
        if requested == "cuda":
            raise ConfigError(f"pool_device: 'cuda' is not possible here: {host_only}")
        return "pinned"
    return gpus[0]


class ChunkPool:
    """``num_slots`` slots of ``slot_bytes`` bytes in one aligned uint8 tensor."""

    def __init__(
        self, num_slots: int, slot_bytes: int, *, device: str = "cpu", prefault: bool = True
    ) -> None:
        _check_positive("num_slots", num_slots)
        _check_positive("slot_bytes", slot_bytes)
        check_device(device)
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._device = device
        self._raw, self._buffer = _allocate_aligned(num_slots * slot_bytes, device)
        if prefault:
            # NOTE: touch every page now. A first write to a fresh page costs
            # ~10x a warm one here (1.3 vs 12 GiB/s), and when it happens inside
            # a remote WRITE it stalls the sender's copy; pay it once at start.
            self._buffer.zero_()
            if self._buffer.device.type == "cuda":
                import torch

                # NOTE: the memset is queued on a stream; NIXL (outside stream
                # order) may write the region as soon as it is registered
                torch.cuda.synchronize(self._buffer.device)
        # NOTE: one numpy view of the whole buffer, shared by every memoryview
        # handed out, so building a memoryview costs a slice and no copy.
        self._array: Any = self._buffer.numpy() if self.is_host else None

    @classmethod
    def carve(cls, region: ChunkPool, slot_bytes: int) -> ChunkPool:
        """A pool of ``slot_bytes`` slots over ``region``'s memory (as many as fit).

        NOTE: for a process that registers its memory with the transport
        before it knows the slot size (the shared store learns it from the
        first engine that attaches): same base address, same registration.
        ``region`` must not be used for chunks once carved.
        """
        _check_positive("slot_bytes", slot_bytes)
        num_slots = region.nbytes // slot_bytes
        if num_slots < 1:
            raise ConfigError(
                f"slot_bytes: {slot_bytes} is larger than the whole region ({region.nbytes} bytes)"
            )
        pool = cls.__new__(cls)
        pool._num_slots, pool._slot_bytes, pool._device = num_slots, slot_bytes, region.device
        pool._raw = region._raw
        pool._buffer = region._buffer.narrow(0, 0, num_slots * slot_bytes)
        pool._array = region._array
        return pool

    @property
    def num_slots(self) -> int:
        """Number of slots in the pool."""
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        """Size of one slot in bytes."""
        return self._slot_bytes

    @property
    def nbytes(self) -> int:
        """Size of the whole region in bytes (``num_slots * slot_bytes``)."""
        return self._num_slots * self._slot_bytes

    @property
    def device(self) -> str:
        """Where the region lives: ``cpu``, ``pinned``, ``cuda`` or ``cuda:N``."""
        return self._device

    @property
    def is_host(self) -> bool:
        """Whether the region is host memory (``cpu`` or ``pinned``)."""
        return self._device in HOST_DEVICES

    @property
    def memory_kind(self) -> str:
        """How NIXL registers the region: ``DRAM`` (host) or ``VRAM``."""
        return "DRAM" if self.is_host else "VRAM"

    @property
    def checksum_name(self) -> Literal["xxh3", "fold64"]:
        """The chunk checksum of this pool: ``xxh3`` (host) or ``fold64`` (VRAM)."""
        return "xxh3" if self.is_host else "fold64"

    def checksum(self, slot: int, nbytes: int) -> int:
        """The pool's checksum of ``slot``'s first ``nbytes`` bytes, where they live.

        A VRAM pool hashes on the device (fabric.kv.fold64, on a stream of
        the calling thread's, after nothing: the bytes must be complete) and
        reads back only the 8-byte result.
        """
        if self.is_host:
            return compute_checksum(self.memoryview(slot, nbytes))
        from fabric.kv.fold64 import fold64

        if not 0 <= nbytes <= self._slot_bytes:
            raise ValueError(f"nbytes {nbytes} outside [0, {self._slot_bytes}]")
        return fold64(self.slot_view(slot).narrow(0, 0, nbytes))

    def staging_buffer(self) -> torch.Tensor:
        """A fresh host buffer of ``slot_bytes`` to copy a slot through
        (pinned when the pool is in VRAM, so the copy is a plain DMA)."""
        return _allocate_staging(self._slot_bytes, pinned=not self.is_host)

    @property
    def base_address(self) -> int:
        """Address of the first byte of slot 0; a multiple of :data:`ALIGNMENT`."""
        return int(self._buffer.data_ptr())

    @property
    def buffer(self) -> torch.Tensor:
        """The whole region: a 1-D uint8 tensor of exactly :attr:`nbytes` bytes."""
        return self._buffer

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` from :attr:`base_address`."""
        self._check_slot(slot)
        return slot * self._slot_bytes

    def slot_view(self, slot: int) -> torch.Tensor:
        """A 1-D uint8 tensor viewing all ``slot_bytes`` bytes of ``slot``."""
        return self._buffer.narrow(0, self.slot_offset(slot), self._slot_bytes)

    def memoryview(self, slot: int, nbytes: int | None = None) -> builtins.memoryview:
        """A writable memoryview of the first ``nbytes`` bytes of ``slot`` (all if None).

        Host pools only: a VRAM slot has no host address (copy it through
        :meth:`staging_buffer`).
        """
        if self._array is None:
            raise ValueError(f"memoryview: the pool is in {self._device} memory, not the host's")
        size = self._slot_bytes if nbytes is None else nbytes
        if not 0 <= size <= self._slot_bytes:
            raise ValueError(f"nbytes {size} outside [0, {self._slot_bytes}]")
        start = self.slot_offset(slot)
        return builtins.memoryview(self._array[start : start + size])

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self._num_slots})")

    def __repr__(self) -> str:
        return (
            f"ChunkPool(num_slots={self._num_slots}, slot_bytes={self._slot_bytes}, "
            f"device={self._device!r}, base_address={self.base_address:#x})"
        )


def _check_positive(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{field}: must be a positive int, got {value!r}")


def _allocate_aligned(nbytes: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``nbytes`` (+ slack) once; return (raw tensor, aligned view of nbytes).

    ConfigError when ``device`` cannot be had here (no CUDA for pinned or
    VRAM memory, a GPU index out of range, not enough memory).
    """
    import torch

    if device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(
            f"device: {device!r} needs a CUDA device, and this torch "
            f"({torch.__version__}) sees none; use device 'cpu'"
        )
    # NOTE: page-locking covers whole pages: a pinned region gets pages of its own
    room = -(-nbytes // ALIGNMENT) * ALIGNMENT if device == "pinned" else nbytes
    try:
        # NOTE: torch.empty; ChunkPool decides whether to touch the pages up front.
        where = "cpu" if device == "pinned" else device
        raw = torch.empty(room + ALIGNMENT, dtype=torch.uint8, device=where)
    except (RuntimeError, AssertionError) as exc:  # OOM, bad ordinal, no driver
        raise ConfigError(f"device: cannot allocate {nbytes} bytes on {device!r}: {exc}") from exc
    shift = -raw.data_ptr() % ALIGNMENT
    aligned = raw.narrow(0, shift, nbytes)
    if device == "pinned":
        _page_lock(raw, raw.narrow(0, shift, room))
    return raw, aligned


def _page_lock(raw: torch.Tensor, region: torch.Tensor) -> None:
    """Page-lock ``region`` (host memory of ``raw``) for CUDA, for ``raw``'s life.

    NOTE: cudaHostRegister of the pool's own pages, not
    ``torch.empty(pin_memory=True)``: torch's caching host allocator rounds
    each block up to a power of two, so a 1.1 GiB pool would lock 2 GiB.
    """
    import torch

    cudart = torch.cuda.cudart()
    address, nbytes = region.data_ptr(), region.numel()
    err = cudart.cudaHostRegister(address, nbytes, 0)
    if int(getattr(err, "value", err)) != 0:  # NOTE: torch's binding marks it handled
        reason = cudart.cudaGetErrorString(err)
        raise ConfigError(f"device: cannot page-lock {nbytes} bytes of host memory ({reason})")
    weakref.finalize(raw, cudart.cudaHostUnregister, address)


def _allocate_staging(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A host uint8 buffer of ``nbytes``; pinned ones come from torch's caching
    host allocator, so asking again per chunk costs no new page-locking."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
