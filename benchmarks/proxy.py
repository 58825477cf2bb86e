"""The PD proxy's added latency and throughput over fake engines, next to the
same load sent straight to the fake decoder.

    python benchmarks/proxy.py [--quick]

Prints a table and the added p50 at one client against both baselines
(direct: one call to the fake decoder; direct_pd: the client calling P then
D itself), writes benchmarks/results/proxy-<date>.json (with
"p50_added_vs_pd_ms_c1" too) and ends with one JSON line: {"p50_added_ms_c1":
.., "p99_added_ms_c32": .., "proxy_rps": .., "direct_rps": ..}, the first
against direct. See fabric/bench/proxy.py for what is measured.
"""

from __future__ import annotations

from pathlib import Path

from fabric.bench.proxy import main

if __name__ == "__main__":
    main(results_dir=Path(__file__).with_name("results"))
