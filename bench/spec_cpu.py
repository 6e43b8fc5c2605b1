"""Speculative decoding on CPU with the embedded SmolLM2, measured with loadgen's `grounded` workload (repeat or
lightly edit a passage) against `aserve serve` started once per configuration:

    python bench/spec_cpu.py [--scenarios c1,sat] [--out DIR]

c1   concurrency 1, greedy: no speculation vs n-gram (fixed k = 4 and auto)
sat  concurrency 32, temperature 1 (saturation): no speculation vs n-gram and layer-skip, fixed k = 4 and auto
c1skip  concurrency 1, greedy: no speculation vs layer-skip k = 4 drafting through the model's head and through an
     int8 copy of it ("draft_head": "int8")

Prints TPOT (mean), output throughput and mean acceptance length per configuration; writes each loadgen JSON
under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from aserve_server import running_server  # noqa: E402

SPECS = {
    "none": None,
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram auto": {"method": "ngram", "num_speculative_tokens": "auto"},
    "layer_skip(15) k=4": {"method": "layer_skip", "num_layers": 15, "num_speculative_tokens": 4},
    "layer_skip(15) auto": {"method": "layer_skip", "num_layers": 15, "num_speculative_tokens": "auto"},
    "layer_skip(15) k=4 int8 head": {
        "method": "layer_skip",
        "num_layers": 15,
        "num_speculative_tokens": 4,
        "draft_head": "int8",
    },
}
SCENARIOS = {
    "c1": dict(concurrency=1, temperature=0.0, num_requests=12, specs=["none", "ngram k=4", "ngram auto"]),
    "sat": dict(concurrency=32, temperature=1.0, num_requests=96, specs=list(SPECS)[:5]),
    "c1skip": dict(
        concurrency=1,
        temperature=0.0,
        num_requests=12,
        specs=["none", "layer_skip(15) k=4", "layer_skip(15) k=4 int8 head"],
    ),
}


def run(scenario: str, spec_name: str, out_dir: str) -> dict:
    cfg = SCENARIOS[scenario]
    spec = SPECS[spec_name]
    extra = ["--speculative-config", json.dumps(spec)] if spec else []
    out = os.path.join(out_dir, f"{scenario}-{spec_name.replace(' ', '_').replace('=', '')}.json")
    with running_server(*extra) as url:
        subprocess.run(
            [sys.executable, "-m", "loadgen", "--url", url, "--workload", "grounded", "--input-len", "96",
             "--concurrency", str(cfg["concurrency"]), "--num-requests", str(cfg["num_requests"]),
             "--temperature", str(cfg["temperature"]), "--warmup", "2", "--seed", "0", "--no-progress",
             "--out", out],
            check=True, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
    with open(out) as f:
        report = json.load(f)
    run_ = report["runs"][0]
    summary, server = run_["summary"], run_.get("server") or {}
    return {
        "tpot_ms": summary["tpot_ms"]["mean"],
        "out_tok_s": summary["output_throughput"],
        "acceptance_len": server.get("spec_decode_mean_acceptance_length"),
        "errors": summary["num_errors"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="c1,sat")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out_dir = args.out or tempfile.mkdtemp()
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for scenario in args.scenarios.split(","):
        base = None
        for spec_name in SCENARIOS[scenario]["specs"]:
            r = run(scenario, spec_name, out_dir)
            base = base or r
            rows.append((scenario, spec_name, r, base))
            print(scenario, spec_name, r, flush=True)
    print("\n| scenario | speculation | TPOT mean (ms) | vs none | output tok/s | vs none | mean acceptance length |")
    print("|---|---|---|---|---|---|---|")
    for scenario, name, r, base in rows:
        acc = f"{r['acceptance_len']:.2f}" if r["acceptance_len"] else "-"
        print(
            f"| {scenario} | {name} | {r['tpot_ms']:.1f} | {base['tpot_ms'] / r['tpot_ms']:.2f}x | "
            f"{r['out_tok_s']:.1f} | {r['out_tok_s'] / base['out_tok_s']:.2f}x | {acc} |"
        )


if __name__ == "__main__":
    main()
