"""A sender that keeps one link: ``push REQUEST_ID SEED`` on stdin pushes CHUNK
pattern chunks over it and prints one JSON line ({"ok": ..., "error": ...});
``quit`` ends it.

    python tests/transfer/repusher.py TRANSPORT ENDPOINT COUNT NBYTES UCX_NET_DEVICES
"""

from __future__ import annotations

import json
import select
import sys
from collections.abc import Iterator

from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from patterns import FINGERPRINT, fill_store

PUSH_TIMEOUT_S = 30.0


def main() -> None:
    transport, endpoint, count, nbytes, devices = sys.argv[1:6]
    size, n = int(nbytes), int(count)
    store = ChunkStore(StoreConfig(slot_bytes=size, num_slots=4 * n))
    config = TransferConfig(
        transport=transport,  # type: ignore[arg-type]
        ucx_net_devices=None if devices == "-" else devices,
        control_timeout_ms=5000,
    )
    with TransferNode(store, config, FINGERPRINT, serve=False, name="repusher") as node:
        link = node.client.connect(endpoint)
        print(json.dumps({"connected": True}), flush=True)
        for line in _lines_while_progressing(node):
            cmd, *args = line.split()
            if cmd == "quit":
                break
            request_id, seed = args[0], int(args[1])
            keys, slots = fill_store(node, seed, n, size)
            try:
                link.push(request_id, keys, slots, timeout=PUSH_TIMEOUT_S)
                out = {"ok": True, "error": None}
            except Exception as exc:
                out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(out), flush=True)


def _lines_while_progressing(node: TransferNode) -> Iterator[str]:
    """stdin's lines; between them the data plane is progressed every 10 ms,
    as an engine's sender and receiver threads do (UCX runs its keepalive
    only inside progress calls)."""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if not ready:
            node.client.plane.take_notifs()
            continue
        line = sys.stdin.readline()
        if not line:
            return
        yield line


if __name__ == "__main__":
    main()
