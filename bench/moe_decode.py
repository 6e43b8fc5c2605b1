"""The few-token MoE kernels (aserve/kernels/moe_decode.py) on the GPU against the grouped path, random weights:

    python bench/moe_decode.py [--shape qwen3-30b-a3b|mixtral-8x7b] [--tune] [--fp8] [--json FILE] [--tiles FILE]

For 1, 2, 4, 8, 16 and 32 tokens: one MoE layer (routing, both projections, the sum over top_k) under a CUDA graph
through moe_decode's three kernels and through the grouped GEMMs (moe.py's SMALL_CONFIG, the configuration the
grouped path takes at these sizes), and the rate at which each reads the distinct experts the tokens picked. `--tune`
first times a grid of each decode kernel's tiles at one token and uses the fastest (`--json` writes them for other
runs). `--fp8`: e4m3 experts with row scales (16-bit activations on both paths at these sizes). The error of each
path against the per-expert torch path is printed beside. Prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from gpu_bench import bench_ms
from moe_kernel import SHAPES, random_experts
from triton.testing import do_bench_cudagraph

from aserve.kernels import moe, moe_decode, moe_routing
from aserve.layers.moe import per_expert_matmuls

TOKENS = (1, 2, 4, 8, 16, 32)


def tune(x, w13, w2, logits, top_k, renormalize, scales) -> tuple[dict, dict]:
    """The fastest launch configuration of each decode kernel at x's number of tokens: tiles first (4 warps, 2
    stages), then warps and stages around the fastest tiles."""
    act, weights, ids = moe_decode.gate_up(x, logits, w13, top_k, renormalize, scales[0])
    runs = {"gate_up": lambda cfg: moe_decode.gate_up(x, logits, w13, top_k, renormalize, scales[0], cfg),
            "down": lambda cfg: moe_decode.down_sum(act, w2, ids, weights, scales[1], cfg)}  # fmt: skip
    best = {}
    for which, run in runs.items():
        timed = {}

        def time(cfg):
            key = tuple(sorted(cfg.items()))
            if key not in timed:
                try:
                    timed[key] = (bench_ms(lambda: run(cfg), 10, 40), cfg)
                except Exception as e:  # out of resources
                    print(f"   {which} {cfg}: {type(e).__name__}")
                    timed[key] = (float("inf"), cfg)

        block_ns = (4, 8, 16) if which == "gate_up" else (1, 2, 4, 8)  # (down: BLOCK_N rows of each of k slots)
        for bn, bk in itertools.product(block_ns, (256, 1024)):
            time(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=2))
        tiles = min(timed.values(), key=lambda t: t[0])[1]
        for warps, stages in ((2, 2), (8, 2), (4, 1), (4, 3)):
            time(dict(tiles, num_warps=warps, num_stages=stages))
        ms, cfg = min(timed.values(), key=lambda t: t[0])
        print(f"   {which}: {ms * 1e3:.1f} us {cfg}", flush=True)
        best[which] = cfg
    return best["gate_up"], best["down"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--tune", action="store_true")
    p.add_argument("--fp8", action="store_true", help="e4m3 experts with row scales")
    p.add_argument("--json", default=None, help="write the tiles used to this file")
    p.add_argument("--tiles", default=None, help="use the tiles a --json file holds")
    args = p.parse_args()
    experts, top_k, hidden, inter, renormalize = SHAPES[args.shape]
    dev, dt = "cuda", torch.bfloat16
    w13, w2, scales, layer = random_experts(args.shape, args.fp8)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    name = f"{args.shape}{' fp8' if args.fp8 else ''}: E={experts} top_k={top_k} H={hidden} I={inter}"
    print(f"{torch.cuda.get_device_name()}, {name}", flush=True)
    gate_up_cfg, down_cfg = moe_decode.GATE_UP, moe_decode.DOWN
    if args.tiles:
        with open(args.tiles) as f:
            tiles = json.load(f)
        gate_up_cfg, down_cfg = tiles["GATE_UP"], tiles["DOWN"]
    if args.tune:
        x = torch.randn(1, hidden, device=dev, dtype=dt)
        logits = torch.randn(1, experts, device=dev, dtype=dt)
        gate_up_cfg, down_cfg = tune(x, w13, w2, logits, top_k, renormalize, scales)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"GATE_UP": gate_up_cfg, "DOWN": down_cfg}, f)

    def decode_layer(x, logits):
        act, weights, ids = moe_decode.gate_up(x, logits, w13, top_k, renormalize, scales[0], gate_up_cfg)
        return moe_decode.down_sum(act, w2, ids, weights, scales[1], down_cfg)

    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device=dev, dtype=dt)
        logits = torch.randn(tokens, experts, device=dev, dtype=dt)
        distinct = len(set(moe_routing.route(logits, top_k, renormalize)[1].flatten().tolist()))
        grouped = lambda: moe.fused_moe(x, logits, w13, w2, top_k, renormalize, moe.SMALL_CONFIG, *scales)  # noqa: E731
        ref = per_expert_matmuls(layer, x, logits).float()
        errs = [((f().float() - ref).norm() / ref.norm()).item() for f in (lambda: decode_layer(x, logits), grouped)]
        d_ms = do_bench_cudagraph(lambda: decode_layer(x, logits))
        g_ms = do_bench_cudagraph(grouped)
        tb = [distinct * expert_bytes / ms / 1e9 for ms in (d_ms, g_ms)]
        rows.append(f"| {tokens} | {moe_decode.use_decode(tokens, top_k, experts)} | {distinct} | "
                    f"{d_ms * 1e3:.1f} us ({tb[0]:.2f} TB/s) | {g_ms * 1e3:.1f} us ({tb[1]:.2f} TB/s) | "
                    f"{g_ms / d_ms:.2f}x | {errs[0]:.1e} / {errs[1]:.1e} |")  # fmt: skip
        print(rows[-1], flush=True)
    print(f"\ntiles: gate_up {gate_up_cfg}, down {down_cfg}")
    print("| tokens | use_decode | distinct experts | decode kernels | grouped (SMALL_CONFIG) | decode speed-up | "
          "rel err decode / grouped |\n|---|---|---|---|---|---|---|")  # fmt: skip
    print("\n".join(rows))


if __name__ == "__main__":
    main()
