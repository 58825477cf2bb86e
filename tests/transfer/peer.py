"""A receiver in its own OS process, driven over stdin/stdout by the tests.

    python tests/transfer/peer.py TRANSPORT NUM_SLOTS SLOT_BYTES QUARANTINE_MS \\
        [HOST [UCX_NET_DEVICES]]

(HOST: where it binds, default 127.0.0.1; UCX_NET_DEVICES: default ``lo``,
``-`` for UCX's own choice)

prints one JSON line {"endpoint": ...}, then answers one JSON line per
command line:
    wait REQUEST_ID TIMEOUT_S SEED   wait for the reservation, check every
                                     byte of every chunk against the pattern
                                     regenerated from SEED, release it
    stats                            store and server counters
    quit
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from fabric.store import ChunkStore, StoreConfig
from fabric.transfer import TransferConfig, TransferNode

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from patterns import FINGERPRINT, chunk_bytes


def check(node: TransferNode, request_id: str, timeout: float, seed: int) -> dict[str, object]:
    assert node.server is not None
    t0 = time.monotonic()
    prog = node.server.wait(request_id, timeout)
    waited = time.monotonic() - t0
    if prog is None:
        return {"known": False, "waited": waited}
    res = node.store.reservation(request_id)
    bad = []
    if res is not None and prog.complete:
        for index, slot in enumerate(res.slots):
            nbytes = node.store.slot_nbytes(slot)
            got = node.store.pool.slot_view(slot)[:nbytes].numpy().tobytes()
            if got != chunk_bytes(seed, index, nbytes):
                bad.append(index)
    out = {
        "known": True,
        "complete": prog.complete,
        "filled": len(prog.filled),
        "failed": sorted(prog.failed),
        "expired": prog.expired,
        "bad": bad,
        "waited": waited,
    }
    node.server.release(request_id)
    return out


def main() -> None:
    transport, num_slots, slot_bytes, quarantine_ms = sys.argv[1:5]
    host = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.1"
    devices = sys.argv[6] if len(sys.argv) > 6 else "lo"
    store = ChunkStore(
        StoreConfig(
            slot_bytes=int(slot_bytes), num_slots=int(num_slots), quarantine_ms=int(quarantine_ms)
        )
    )
    config = TransferConfig(
        transport=transport,  # type: ignore[arg-type]
        host=host,
        insecure=True,  # NOTE: a test peer, reachable inside its namespace only
        ucx_net_devices=None if devices == "-" else devices,
    )
    with TransferNode(store, config, FINGERPRINT, name=f"peer-{transport}") as node:
        print(json.dumps({"endpoint": node.endpoint}), flush=True)
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "quit":
                break
            if cmd == "wait":
                out = check(node, args[0], float(args[1]), int(args[2]))
            elif cmd == "stats":
                assert node.server is not None
                out = {
                    "store": dataclasses.asdict(store.stats()),
                    "reserved": store.reserved_count(),
                    "server": dataclasses.asdict(node.server.stats),
                }
            else:
                out = {"error": f"unknown command {cmd}"}
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
