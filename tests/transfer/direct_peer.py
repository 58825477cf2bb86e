"""A prefiller's cache in its own OS process, for direct-read tests.

    python tests/transfer/direct_peer.py SEED

Builds the cache of :func:`cache` (random bytes from SEED), registers it
with a NIXL data plane (driven every ms, as fabric's server drives its own)
and prints one JSON line: the plane's descriptor
and region descriptor (hex), and where the chunk of ``BLOCK_IDS`` lies in the cache (offsets,
addresses, lengths) with its checksum. Then one JSON line per command:
    flip       flip a byte of the chunk; answers the new checksum
    notifs     the notifications taken so far
    peer DESC  load the reader's plane descriptor (hex), as a Hello's answer
               would (a same-host reader is then told who this process is);
               answers the region descriptor for that reader
    quit
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from fabric.kv import KVLayout
from fabric.kv.direct import cache_regions, cache_spans, checksum_spans
from fabric.transfer.nixl_plane import NixlDataPlane

BLOCK_IDS = [9, 3, 4, 5, 20, 17, 30, 0]
# NOTE: 3 MiB: a cache large enough to be shared with readers of this host
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 96, 16, 2, 64


def cache(seed: int) -> list[torch.Tensor]:
    """FLASH-layout layers in one allocation, as vLLM's CPU worker keeps them."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    numel = LAYERS * 2 * BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM
    raw = torch.randint(0, 256, (numel * 2,), dtype=torch.uint8, generator=gen)
    return list(raw.view(torch.bfloat16).view(LAYERS, *shape).unbind(0))


def main() -> None:
    seed = int(sys.argv[1])
    layers = cache(seed)
    layout = KVLayout.from_tensors(layers)
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    plane = NixlDataPlane(f"direct-peer-{seed}", ucx_net_devices="lo")
    plane.register_pool(pool.data_ptr(), pool.numel())
    for base, nbytes in cache_regions(layers):
        plane.register_region(base, nbytes)
    spans = cache_spans(layers, layout, BLOCK_IDS)
    hello = {
        "descriptor": plane.descriptor().hex(),
        "regions": plane.region_descriptor().hex(),
        "offsets": spans.offsets.tolist(),
        "addrs": spans.addrs.tolist(),
        "lengths": spans.lengths.tolist(),
        "nbytes": spans.nbytes,
        "checksum": checksum_spans(spans.addrs, spans.lengths),
    }
    stop = threading.Event()
    notifs: list[str] = []

    def progress() -> None:
        # NOTE: as fabric's server does: the agent is driven at a steady rate
        # (connection wire-up needs the reader's peer to answer)
        while not stop.is_set():
            notifs.extend(msg.decode() for _, msg in plane.take_notifs())
            time.sleep(1e-3)

    driver = threading.Thread(target=progress, daemon=True)
    driver.start()
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "flip":
            layers[LAYERS - 1][1, BLOCK_IDS[-1], BLOCK_SIZE - 1, HEADS - 1, HEAD_DIM - 1] += 1
            print(json.dumps({"checksum": checksum_spans(spans.addrs, spans.lengths)}), flush=True)
        if cmd[0] == "peer":
            name = plane.add_peer(bytes.fromhex(cmd[1]))
            regions = plane.region_descriptor(name).hex()  # NOTE: for that reader only
            print(json.dumps({"peer": name, "regions": regions}), flush=True)
        if cmd[0] == "notifs":
            print(json.dumps({"notifs": list(notifs)}), flush=True)
    stop.set()
    driver.join()
    plane.close()


if __name__ == "__main__":
    main()
