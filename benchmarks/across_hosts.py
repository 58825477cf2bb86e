"""TTFT across simulated hosts with the prefiller's link capped at 1 Gbit/s, next to uncapped.

Three network namespaces on one bridge (``tests/netns.py``): the prefiller
on hostp, the decoder on hostd, the proxy on hostx, each started by its own
``fabric up --host`` (NIXL over UCX TCP on ``eth0``, as
``tests/e2e/test_across_hosts.py`` runs them), on the KV-heavy tiny model
(Llama-3-8B's KV geometry: 128 KiB per token in bf16, so a 1,000-token
prompt carries 125 MiB of KV, one second at 1 Gbit/s; twice that in
float32). Rounds alternate capped (``tc tbf`` on hostp's ``eth0``) and
uncapped requests of fresh prompts;
the decoder's own ``vllm:fabric_load_seconds`` and the prefiller's
``vllm:request_prefill_time_seconds`` are read around each request, so the
handoff (TTFT less the prefill) is reported beside TTFT. Needs root
(``ip netns``); ~10 minutes on 2 cores (a KV-heavy prefill takes ~15 s per
1,000 tokens on one core here).

    python benchmarks/across_hosts.py [--rounds 5] [--tokens 1000] [--rate 1gbit]
                                      [--dtype bfloat16]

The last stdout line is JSON, also saved to
``benchmarks/results/across-hosts-<date>.json``:
``{"ttft_capped_over_uncapped": .., "ttft_capped_s": .., "ttft_uncapped_s": ..,
"handoff_capped_s": .., "handoff_uncapped_s": ..}`` (medians).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fabric.testing.models import make_tiny_model  # noqa: E402
from tests.e2e import test_across_hosts as rig_module  # noqa: E402
from tests.e2e._ns_client import NsClient  # noqa: E402
from tests.e2e._pd import prompt_ids  # noqa: E402
from tests.netns import Hosts  # noqa: E402

MODEL = "tiny-kv-heavy"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="the engines' --dtype (float32 doubles the KV; on a CPU without "
        "bf16 instructions it prefills several times faster)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fabric-across-") as tmp:
        result = run(Path(tmp), args)
    out = args.out or ROOT / "benchmarks" / "results" / f"across-hosts-{datetime.date.today()}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]))


def run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    model_dir = make_tiny_model(root / "models" / MODEL, kv_heavy=True)
    os.environ[rig_module.SECRET_VAR] = "across-hosts-benchmark"
    with Hosts(rig_module.HOSTS) as hosts:
        runs = []
        client = NsClient(hosts, "hostx")
        try:
            for name in rig_module.HOSTS:
                runs.append(
                    rig_module._fabric_up(
                        hosts,
                        root,
                        name,
                        "nixl",
                        model_dir,
                        model=MODEL,
                        engine_args=["--dtype", args.dtype],
                        # NOTE: a 4,096-token sequence's KV is 1 GiB in float32
                        kv_cache_gib=2 if args.dtype == "float32" else 1,
                    )
                )
            runs[2].wait_line(r"proxy serving at", timeout=rig_module.START_TIMEOUT_S)
            rig = rig_module.Rig(hosts, "nixl", runs, client, None)  # type: ignore[arg-type]
            rig.wait_healthy(rig_module.START_TIMEOUT_S)
            rig_module._wait_ready(rig)
            samples = measure(rig, args)
        finally:
            hosts.cap("hostp", None)
            client.close()
            for run_ in runs:
                if run_.process.poll() is None:
                    run_.stop(timeout=120)
                run_.kill_all()
    return {"args": vars(args) | {"out": None}, "samples": samples, "summary": summarize(samples)}


def measure(rig: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    samples = []
    for round_ in range(args.rounds):
        for capped in (False, True) if round_ % 2 == 0 else (True, False):
            rig.hosts.cap("hostp", args.rate if capped else None)
            prompt = prompt_ids(args.tokens, seed=7000 + 2 * round_ + capped)
            prefill_before = rig.metric("hostp", "vllm:request_prefill_time_seconds_sum")
            external_before = rig.metric(
                "hostd", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
            )
            result = rig.client.call(
                rig.proxy("/v1/completions"), rig_module.request(prompt, model=MODEL)
            )
            assert result["status"] == 200, result
            prefill_s = (
                rig.metric("hostp", "vllm:request_prefill_time_seconds_sum") - prefill_before
            )
            external = rig.metric(
                "hostd", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
            )
            sample = {
                "round": round_,
                "capped": capped,
                "ttft_s": round(result["ttft_s"], 3),
                "prefill_s": round(prefill_s, 3),
                "handoff_s": round(result["ttft_s"] - prefill_s, 3),
                "kv_over_fabric": external - external_before >= args.tokens - 1,
            }
            print(json.dumps(sample), flush=True)
            samples.append(sample)
    return samples


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    def median(capped: bool, key: str) -> float:
        return round(statistics.median(s[key] for s in samples if s["capped"] == capped), 3)

    summary = {
        "ttft_capped_s": median(True, "ttft_s"),
        "ttft_uncapped_s": median(False, "ttft_s"),
        "handoff_capped_s": median(True, "handoff_s"),
        "handoff_uncapped_s": median(False, "handoff_s"),
    }
    summary["ttft_capped_over_uncapped"] = round(
        summary["ttft_capped_s"] / summary["ttft_uncapped_s"], 3
    )
    summary["all_kv_over_fabric"] = all(s["kv_over_fabric"] for s in samples)
    return summary


if __name__ == "__main__":
    main()
