"""A sender in its own OS process: fill chunks with the test pattern, push them, say how it went.

    python tests/transfer/pusher.py TRANSPORT ENDPOINT REQUEST_ID SEED COUNT NBYTES \\
        [UCX_NET_DEVICES]

prints one JSON line: {"ok": true, "nbytes": N} or {"ok": false, "error": "..."}.
(UCX_NET_DEVICES: default ``lo``, ``-`` for UCX's own choice.)
"""

from __future__ import annotations

import json
import sys

from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from patterns import FINGERPRINT, chunk_bytes, chunk_key

PUSH_TIMEOUT_S = 30.0


def main() -> None:
    transport, endpoint, request_id, seed, count, nbytes = sys.argv[1:7]
    devices = sys.argv[7] if len(sys.argv) > 7 else "lo"
    size, n = int(nbytes), int(count)
    store = ChunkStore(StoreConfig(slot_bytes=size, num_slots=n + 1))
    config = TransferConfig(
        transport=transport,  # type: ignore[arg-type]
        ucx_net_devices=None if devices == "-" else devices,
        control_timeout_ms=5000,
    )
    with TransferNode(store, config, FINGERPRINT, serve=False, name="pusher") as node:
        keys, slots = [], []
        for index in range(n):
            key = chunk_key(int(seed), index)
            slot = store.allocate(key)
            store.pool.slot_view(slot)[:size].numpy()[:] = memoryview(
                chunk_bytes(int(seed), index, size)
            )
            store.commit(slot, key, size)
            keys.append(key)
            slots.append(store.acquire([key])[0])
        try:
            link = node.client.connect(endpoint)
            link.push(request_id, keys, slots, timeout=PUSH_TIMEOUT_S)
        except Exception as exc:
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            return
        print(json.dumps({"ok": True, "nbytes": size * n}), flush=True)


if __name__ == "__main__":
    main()
