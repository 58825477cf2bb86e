"""Moving chunks between processes: ZMQ control channel + NIXL/TCP data plane.

Knows nothing of vLLM; see ``server`` (receiving end), ``client`` (sending
end), ``dataplane`` (the WRITE + notify interface) and ``protocol`` (wire).
"""

from __future__ import annotations

from fabric.transfer.client import PeerLink, PendingPush, RemoteReservation, TransferClient
from fabric.transfer.config import TransferConfig, open_data_plane
from fabric.transfer.dataplane import DataPlane, LoopbackDataPlane, XferState
from fabric.transfer.node import TransferNode, default_agent_name
from fabric.transfer.server import RequestProgress, ServerStats, TransferServer

__all__ = [
    "DataPlane",
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
