"""Move the same KV bytes between two processes: memcpy, raw NIXL, page-granular
NIXL, fabric's push and fabric's full path (pack + push + unpack).

    python benchmarks/transfer.py [--tokens 2048] [--reps 5] [--progress both]

Prints a table, writes benchmarks/results/transfer-<date>.json and ends with
one JSON line: {"push_vs_raw": .., "full_vs_raw": .., "full_vs_page": ..}
(progress thread off, the default). ``raw`` and ``page`` are one WRITE of the
whole transfer here; ``push`` and ``full`` move ``--chunk-tokens`` chunks. The sweep
over chunk sizes, batches, geometries and transports is ``fabric bench transfer``.
"""

from __future__ import annotations

from pathlib import Path

from fabric.bench.transfer import main

if __name__ == "__main__":
    main(results_dir=Path(__file__).with_name("results"))
