"""Host memory posing as VRAM, for testing the VRAM pool's paths without a GPU.

:func:`host_backed_vram` (given pytest's ``monkeypatch``) lets
:class:`~fabric.store.pool.ChunkPool` be built on ``cuda``/``cuda:N`` with
host memory behind it, and the loopback data plane register it. Everything
that decides by the pool's device then runs for real: no memoryview of a
VRAM slot, fold64 instead of xxh3, pinned staging for the disk tier, Hellos
that carry the pool's checksum. Only the allocation (and the plane's
host-memory-only check) is faked; the loopback plane copies host addresses,
which these are. Never for a real GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["host_backed_vram"]


def host_backed_vram(monkeypatch: Any) -> list[bool]:
    """Patch pools and the loopback plane as above; returns the ``pinned``
    flag of every staging buffer asked for from then on (appended)."""
    import torch

    from fabric.store import pool as pool_module
    from fabric.transfer.dataplane import LoopbackDataPlane

    staged: list[bool] = []
    real_staging = pool_module._allocate_staging

    def allocate(nbytes: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        pool_module.check_device(device)
        raw = torch.empty(nbytes + pool_module.ALIGNMENT, dtype=torch.uint8)
        shift = -raw.data_ptr() % pool_module.ALIGNMENT
        return raw, raw.narrow(0, shift, nbytes)

    def staging(nbytes: int, *, pinned: bool) -> torch.Tensor:
        staged.append(pinned)
        return real_staging(nbytes, pinned=False)

    def register(self: LoopbackDataPlane, base_address: int, nbytes: int, device: str) -> None:
        pool_module.check_device(device)

    monkeypatch.setattr(pool_module, "_allocate_aligned", allocate)
    monkeypatch.setattr(pool_module, "_allocate_staging", staging)
    monkeypatch.setattr(LoopbackDataPlane, "_register", register)
    return staged
