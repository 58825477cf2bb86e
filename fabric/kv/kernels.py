"""How a chunk is gathered from (and scattered into) caches on an accelerator.

:class:`DeviceKernels` is what :mod:`fabric.kv.pack` calls for a cache that is
not on the CPU; :class:`TorchIndexKernels` is the portable implementation
(torch indexing) and :mod:`fabric.kv.cuda` picks the fused ``fabric/kv/csrc/`` kernels
where they load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch


class DeviceKernels(Protocol):
    """Pack/unpack for caches on an accelerator (the fabric/kv/csrc/ kernels plug in here)."""

    def pack(self, views: list[torch.Tensor], ids: np.ndarray, dst: torch.Tensor) -> None:
        """Gather blocks ``ids`` of each segment view into chunk bytes ``dst``."""

    def unpack(self, src: torch.Tensor, views: list[torch.Tensor], ids: np.ndarray) -> None:
        """Scatter chunk bytes ``src`` into blocks ``ids`` of each segment view."""


class TorchIndexKernels:
    """Device-side pack/unpack with torch indexing: correct, one launch per row."""

    def pack(self, views: list[torch.Tensor], ids: np.ndarray, dst: torch.Tensor) -> None:
        """Gather on the cache's device, then copy to ``dst`` if it lives elsewhere."""
        import torch

        device = views[0].device
        index = torch.as_tensor(ids, device=device)
        staged = torch.stack([v.index_select(0, index) for v in views])
        dst.copy_(staged.view(-1))

    def unpack(self, src: torch.Tensor, views: list[torch.Tensor], ids: np.ndarray) -> None:
        """Move ``src`` to the cache's device, then scatter each row."""
        import torch

        device = views[0].device
        index = torch.as_tensor(ids, device=device)
        rows = src.to(device).view(len(views), len(ids), -1)
        for view, row in zip(views, rows, strict=True):
            view.index_copy_(0, index, row)
