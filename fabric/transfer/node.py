"""A process's complete transfer endpoint: data plane + server + client."""

from __future__ import annotations

import os
import socket
import uuid
from typing import TYPE_CHECKING

from fabric.transfer.client import TransferClient
from fabric.transfer.config import TransferConfig, open_data_plane
from fabric.transfer.fence import RefuseWrites
from fabric.transfer.server import TransferServer

if TYPE_CHECKING:
    from fabric.store import ChunkStore
    from fabric.store.tier import TieredStore


def default_agent_name(prefix: str = "fabric") -> str:
    """A name unique across hosts, processes and restarts."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class TransferNode:
    """Registers ``store``'s pool with one data plane, serves and sends.

    ``serve=False`` builds a send-only node (no control socket is bound, and
    its data plane refuses writes into its pool where it can).
    Close it (or use it as a context manager) to stop threads and sockets.
    """

    def __init__(
        self,
        store: ChunkStore,
        config: TransferConfig,
        fingerprint: str,
        *,
        name: str | None = None,
        serve: bool = True,
        tier: TieredStore | None = None,
    ) -> None:
        self.store, self.config = store, config
        self.plane = open_data_plane(config, name or default_agent_name())
        try:
            pool = store.pool
            self.plane.register_pool(pool.base_address, pool.nbytes, str(pool.device))
            self.client = TransferClient(store, self.plane, config, fingerprint)
            self.server = (
                TransferServer(store, self.plane, config, fingerprint, tier=tier).start()
                if serve
                else None
            )
            if not serve:
                self.plane.set_write_guard(RefuseWrites())
        except BaseException:
            self.plane.close()
            raise

    @property
    def endpoint(self) -> str:
        if self.server is None:
            raise RuntimeError("send-only node has no endpoint")
        return self.server.endpoint

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.close()
        self.plane.close()

    def __enter__(self) -> TransferNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
