"""Plain NIXL agents for the baselines: no fabric protocol, no checksums.

Used by ``fabric.bench.transfer`` to measure what NIXL itself does with one
contiguous region (the ceiling) and with one descriptor per KV page (what
vLLM's NixlConnector posts).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from fabric.errors import TransferTimeout, TransportFailed

if TYPE_CHECKING:
    import torch


class RawNixl:
    """One NIXL agent with regions of one memory kind registered (``DRAM``, or
    ``VRAM`` for caches on a GPU), driven by its caller unless ``progress_thread``."""

    def __init__(self, name: str, *, progress_thread: bool = False, mem_type: str = "DRAM") -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from nixl._api import nixl_agent, nixl_agent_config

        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.agent: Any = nixl_agent(name, config)
        self.name = name
        self.mem_type = mem_type
        self._regs: list[Any] = []

    def register(self, tensor: torch.Tensor) -> None:
        self._regs.append(self.agent.register_memory(tensor))

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> Any:
        """Post one WRITE of Nx3 (addr, len, dev) descriptor arrays."""
        handle = self.agent.initialize_xfer(
            "WRITE",
            self.agent.get_xfer_descs(local, self.mem_type),
            self.agent.get_xfer_descs(remote, self.mem_type),
            peer,
            notif,
        )
        if self.agent.transfer(handle) == "ERR":
            raise TransportFailed("NIXL refused the write")
        return handle

    def prep(self, descs: np.ndarray, peer: str = "") -> Any:
        """Prepare a descriptor list once (local when ``peer`` is empty)."""
        return self.agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", descs, self.mem_type)

    def prepped_write(
        self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes
    ) -> Any:
        handle = self.agent.make_prepped_xfer("WRITE", local, local_idx, remote, remote_idx, notif)
        if self.agent.transfer(handle) == "ERR":
            raise TransportFailed("NIXL refused the write")
        return handle

    def wait(self, handle: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while (state := self.agent.check_xfer_state(handle)) == "PROC":
            if time.monotonic() > deadline:
                raise TransferTimeout("raw NIXL write did not finish")
            time.sleep(0)
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransportFailed(f"raw NIXL write ended in {state}")

    def wait_notifs(self, count: int, timeout: float, poll_s: float = 2e-4) -> int:
        """Poll for ``count`` notifications at a steady rate, as fabric's server does."""
        got = 0
        deadline = time.monotonic() + timeout
        while got < count and time.monotonic() < deadline:
            got += sum(len(v) for v in self.agent.get_new_notifs().values())
            if got < count:
                time.sleep(poll_s)
        return got

    def close(self) -> None:
        """Deregister every region (the agent itself goes with the object)."""
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        self._regs.clear()


def descs(addrs: np.ndarray, nbytes: int | np.ndarray, device_id: int = 0) -> np.ndarray:
    """Nx3 uint64 descriptor array (addr, len, device id)."""
    out = np.zeros((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = nbytes
    out[:, 2] = device_id
    return out
