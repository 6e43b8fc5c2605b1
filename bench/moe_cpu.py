"""One mixture-of-experts layer on the CPU, bf16 random weights, its paths alternating --rounds times and each one's
best kept. One token (decode, the default): the per-expert rows path (F.linear over each chosen expert's rows)
against the C GEMV path it takes where the CPU has one (`expert_gemv`, aserve/layers/moe.py). --tokens N > 1 (a
prompt's step): F.linear per expert against the widened float32 GEMMs (`expert_linear`, aserve/layers/linear.py's
widened_linear, which CPUs without a native bf16 GEMM take):

    python bench/moe_cpu.py [--experts 128 --top-k 8 --hidden 2048 --inter 768] [--tokens 1] [--rounds 5]

(the defaults: Qwen3-30B-A3B's experts). Prints a table: ms per layer and the rate at which each reads the chosen
experts' weights (one token) or the tokens per second through the layer.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from aserve.layers.linear import widened_linear
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
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    layer = FusedMoE(args.experts, args.top_k, args.hidden, args.inter, renormalize=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.w13.normal_(0, args.hidden**-0.5)
        layer.w2.normal_(0, args.inter**-0.5)
    layer.process_weights_after_loading()
    if args.tokens == 1 and not layer.expert_gemv:
        raise SystemExit(
            "the C GEMV does not take these experts here (aserve/kernels/cpu.py gemv_supports: "
            "AVX512-BF16, K a multiple of 32 up to MAX_GEMV_K, the C kernels on)"
        )
    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16)
    logits = torch.randn(args.tokens, args.experts, dtype=torch.bfloat16)
    if args.tokens == 1:
        paths = {"rows (F.linear per expert)": dict(expert_gemv=False), "C GEMV per expert": dict(expert_gemv=True)}
    else:
        paths = {"F.linear per expert": dict(expert_linear=F.linear, expert_gemv=False),
                 "widened float32 GEMMs per expert": dict(expert_linear=widened_linear, expert_gemv=False)}  # fmt: skip
    best = dict.fromkeys(paths, float("inf"))
    repeats = 20 // args.tokens + 2
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, attrs in paths.items():
                for attr, value in attrs.items():
                    setattr(layer, attr, value)
                best[name] = min(best[name], best_ms(lambda: per_expert_matmuls(layer, x, logits), repeats))
    print(f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert intermediate {args.inter}, "
          f"{args.tokens} token(s), {torch.get_num_threads()} threads\n")  # fmt: skip
    if args.tokens == 1:
        chosen_bytes = args.top_k * 3 * args.hidden * args.inter * 2
        print("| path | ms per layer | GB/s of the chosen experts |\n|---|---|---|")
        for name, ms in best.items():
            print(f"| {name} | {ms:.2f} | {chosen_bytes / ms / 1e6:.1f} |")
    else:
        print("| path | ms per layer | tokens / s through the layer |\n|---|---|---|")
        for name, ms in best.items():
            print(f"| {name} | {ms:.2f} | {args.tokens / ms * 1e3:.0f} |")
    first, second = best.values()
    print(f"\nspeed-up {first / second:.2f}x")


if __name__ == "__main__":
    main()
