"""``benchmarks/proxy.py --quick`` runs end to end (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_proxy_benchmark_runs_and_ends_with_its_json_line(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "proxy.py"

    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )

    assert done.returncode == 0, done.stderr[-2000:]
    headline = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(headline) == {"p50_added_ms_c1", "p99_added_ms_c32", "proxy_rps", "direct_rps"}
    [saved] = tmp_path.glob("proxy-*.json")
    record = json.loads(saved.read_text())
    assert record["headline"] == headline
    assert all(run["errors"] == 0 for run in record["runs"])
