"""Moving chunks between processes: ZMQ control channel + NIXL/TCP data plane.

Knows nothing of vLLM; see ``server`` (receiving end), ``client`` (sending
end), ``dataplane`` (the WRITE + notify interface), ``protocol`` (wire,
signing) and ``faults`` (fault injection for tests).
"""

from __future__ import annotations

from fabric.transfer.client import PeerLink, PendingPush, RemoteReservation, TransferClient
from fabric.transfer.config import TransferConfig, open_data_plane
from fabric.transfer.dataplane import DataPlane, LoopbackDataPlane, XferState
from fabric.transfer.faults import FaultConfig
from fabric.transfer.node import TransferNode, default_agent_name
from fabric.transfer.progress import RequestProgress
from fabric.transfer.server import TransferServer
from fabric.transfer.server_stats import ServerStats

__all__ = [
    "DataPlane",
    "FaultConfig",
    "LoopbackDataPlane",
    "PeerLink",
    "PendingPush",
    "RemoteReservation",
    "RequestProgress",
    "ServerStats",
    "TransferClient",
    "TransferConfig",
    "TransferNode",
    "TransferServer",
    "XferState",
    "default_agent_name",
    "open_data_plane",
]
