"""One mixture-of-experts layer at one token on the CPU (decode), bf16 random weights: the per-expert rows path
(F.linear over each chosen expert's rows) against the C GEMV path it takes where the CPU has one (`expert_gemv`,
aserve/layers/moe.py), alternating --rounds times and keeping each one's best:

    python bench/moe_cpu.py [--experts 128 --top-k 8 --hidden 2048 --inter 768] [--rounds 5]

(the defaults: Qwen3-30B-A3B's experts). Prints a table: ms per layer and the rate at which each reads the chosen
experts' weights.
"""

from __future__ import annotations

import argparse
import time

import torch

from aserve.layers.moe import FusedMoE, per_expert_matmuls


def best_ms(fn, repeats: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    layer = FusedMoE(args.experts, args.top_k, args.hidden, args.inter, renormalize=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.w13.normal_(0, args.hidden**-0.5)
        layer.w2.normal_(0, args.inter**-0.5)
    layer.process_weights_after_loading()
    if not layer.expert_gemv:
        raise SystemExit(
            "the C GEMV does not take these experts here (aserve/kernels/cpu.py gemv_supports: "
            "AVX512-BF16, K a multiple of 32 up to MAX_GEMV_K, the C kernels on)"
        )
    x = torch.randn(1, args.hidden, dtype=torch.bfloat16)
    logits = torch.randn(1, args.experts, dtype=torch.bfloat16)
    chosen_bytes = args.top_k * 3 * args.hidden * args.inter * 2
    best = {False: float("inf"), True: float("inf")}
    with torch.no_grad():
        for _ in range(args.rounds):
            for gemv in (False, True):
                layer.expert_gemv = gemv
                best[gemv] = min(best[gemv], best_ms(lambda: per_expert_matmuls(layer, x, logits)))
    print(f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert intermediate {args.inter}, "
          f"{torch.get_num_threads()} threads\n")  # fmt: skip
    print("| path | ms per layer | GB/s of the chosen experts |\n|---|---|---|")
    for gemv, name in ((False, "rows (F.linear per expert)"), (True, "C GEMV per expert")):
        print(f"| {name} | {best[gemv]:.2f} | {chosen_bytes / best[gemv] / 1e6:.1f} |")
    print(f"\nspeed-up {best[False] / best[True]:.2f}x")


if __name__ == "__main__":
    main()
