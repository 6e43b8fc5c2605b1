"""The int4 MoE kernels (aserve/kernels/moe_int4.py: AWQ / GPTQ experts kept packed) against the 16-bit ones
(aserve/kernels/moe.py, moe_decode.py) on the GPU, random experts:

    python bench/moe_int4.py [--shape qwen3-30b-a3b|mixtral-8x7b] [--group 128] [--tokens 1,4,64,2048] [--tune]
        [--no-pdl]

For each number of tokens, one MoE layer (routing, both projections, the sum over top_k) under a CUDA graph: the
int4 kernels over packed experts (random nibbles, zero points and fp16 scales; weights of about N(0, 1/H)) and the
16-bit kernels over the same experts dequantised to bf16, each through fused_moe's own choice of path (the few-token
kernels where moe_decode.use_decode holds, else the grouped GEMMs); the rate at which each reads the weights of the
distinct experts the tokens picked (int4: packed bytes with zero points and scales); and the relative error of the
int4 layer against the 16-bit one (the same weights: only accumulation order and rounding differ). `--tune` first
times a grid of the int4 kernels' launch configurations at each size and uses the fastest (printed, to copy into
moe_int4.py). Without a CUDA GPU it exits with a message (the kernels' checks on CPU: tests/test_moe_int4_kernels.py).
Prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from aserve.kernels.moe_int4_reference import Int4Experts, dequantize, pack

SHAPES = {  # experts, top_k, hidden, expert intermediate, renormalise (as bench/moe_kernel.py)
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}


def random_int4(experts: int, rows: int, cols: int, group: int, gen: torch.Generator) -> Int4Experts:
    """Packed experts on the GPU: random nibbles and zero points, scales that give weights of about N(0, 1/cols)."""
    q = torch.randint(0, 16, (experts, rows, cols), generator=gen, device="cuda")
    z = torch.randint(0, 16, (experts, rows, cols // group), generator=gen, device="cuda", dtype=torch.uint8)
    s = torch.full((experts, rows, cols // group), cols**-0.5 / 6.5, device="cuda", dtype=torch.float16)
    return Int4Experts(pack(q), z, s)


def nbytes(w: Int4Experts | torch.Tensor, experts: int) -> int:
    """Bytes of `experts` experts of a stack (packed: weights, zero points and scales)."""
    parts = w if isinstance(w, Int4Experts) else (w,)
    return sum(t[0].numel() * t.element_size() for t in parts) * experts


def tune(x, logits, w13, w2, top_k, renormalize) -> dict:
    """The fastest int4 launch configuration at x's number of tokens: the few-token kernels' tiles where
    use_decode holds, else the grouped GEMMs' (each GEMM timed alone on one routing)."""
    from gpu_bench import bench_ms

    from aserve.kernels import moe_align, moe_decode, moe_int4

    experts = w13.shape[0]
    if moe_decode.use_decode(x.shape[0], top_k, experts):
        act, weights, ids = moe_int4.gate_up(x, logits, w13, top_k, renormalize)
        runs = {"gate_up": lambda cfg: moe_int4.gate_up(x, logits, w13, top_k, renormalize, cfg),
                "down": lambda cfg: moe_int4.down_sum(act, w2, ids, weights, cfg)}  # fmt: skip
        grid = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=2)
                for bn, bk, w in itertools.product((4, 8, 16), (64, 128), (2, 4))]  # fmt: skip
        return {which: _fastest(which, run, grid, bench_ms) for which, run in runs.items()}
    best = None
    for block_m in (16, 32) if x.shape[0] * top_k <= 16 * experts else (64, 128):
        weights, _, sorted_slots, block_experts = moe_align.route_and_align(logits, top_k, renormalize, block_m)
        n = x.shape[0] * top_k
        act = torch.randn(n, w2.shape[2], dtype=x.dtype, device=x.device)
        out = torch.empty(n, x.shape[1], dtype=x.dtype, device=x.device)
        runs = {"gate_up": lambda cfg: moe_int4.grouped_gemm(x, w13, act, sorted_slots, block_experts, block_m, cfg,
                                                             top_k, True),
                "down": lambda cfg: moe_int4.grouped_gemm(act, w2, out, sorted_slots, block_experts, block_m, cfg, 1,
                                                          False, weights)}  # fmt: skip
        tiles = itertools.product((64, 128), (64, 128), (8,), (4, 8), (3, 4))
        grid = [dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=w, num_stages=st) for bn, bk, gm, w, st in tiles]
        chosen = {"BLOCK_M": block_m}
        total = 0.0
        for which, run in runs.items():
            ms, chosen[which] = _fastest(f"BLOCK_M {block_m} {which}", run, grid, bench_ms, with_time=True)
            total += ms
        if best is None or total < best[0]:
            best = (total, chosen)
    return best[1]


def _fastest(name, run, grid, bench_ms, with_time=False):
    timed = []
    for cfg in grid:
        try:
            timed.append((bench_ms(lambda: run(cfg), 10, 40), cfg))
        except Exception as e:  # out of resources
            print(f"   {name} {cfg}: {type(e).__name__}")
    ms, cfg = min(timed, key=lambda t: t[0])
    print(f"   {name}: {ms * 1e3:.1f} us {cfg}", flush=True)
    return (ms, cfg) if with_time else cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--group", type=int, default=128, help="quantisation group size")
    p.add_argument("--tokens", default="1,4,64,2048")
    p.add_argument("--tune", action="store_true", help="time a grid of int4 launch configurations first")
    p.add_argument("--no-pdl", action="store_true", help="programmatic dependent launch off")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("moe_int4: the timings need a CUDA GPU (the kernels' CPU checks: tests/test_moe_int4_kernels.py)")
        return 2
    from triton.testing import do_bench_cudagraph

    from aserve.kernels import moe, moe_decode, moe_int4, moe_routing, pdl

    pdl.enable(not args.no_pdl and torch.cuda.get_device_capability()[0] >= 9)
    experts, top_k, hidden, inter, renormalize = SHAPES[args.shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = random_int4(experts, 2 * inter, hidden, args.group, gen), random_int4(experts, hidden, inter,
                                                                                     args.group, gen)  # fmt: skip
    d13, d2 = dequantize(w13).bfloat16(), dequantize(w2).bfloat16()
    int4_bytes, bf16_bytes = nbytes(w13, 1) + nbytes(w2, 1), nbytes(d13, 1) + nbytes(d2, 1)
    print(f"{torch.cuda.get_device_name()}, {args.shape}: E={experts} top_k={top_k} H={hidden} I={inter} "
          f"group {args.group}; one expert {int4_bytes / 2**20:.2f} MiB int4, {bf16_bytes / 2**20:.2f} MiB bf16; "
          f"PDL {'on' if pdl.ENABLED else 'off'}", flush=True)  # fmt: skip
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        path = "few-token" if moe_decode.use_decode(tokens, top_k, experts) else "grouped"
        saved = (moe_int4.SMALL_CONFIG, moe_int4.LARGE_CONFIG, moe_int4.GATE_UP, moe_int4.DOWN)
        if args.tune:
            print(f"== tuning the int4 {path} kernels at {tokens} tokens", flush=True)
            best = tune(x, logits, w13, w2, top_k, renormalize)
            if path == "few-token":
                moe_int4.GATE_UP, moe_int4.DOWN = best["gate_up"], best["down"]
            else:
                moe_int4.SMALL_CONFIG = moe_int4.LARGE_CONFIG = best
            print(f"   chosen: {best}", flush=True)
        int4 = lambda: moe_int4.fused_moe(x, logits, w13, w2, top_k, renormalize)  # noqa: E731
        bf16 = lambda: moe.fused_moe(x, logits, d13, d2, top_k, renormalize)  # noqa: E731
        err = ((int4().float() - bf16().float()).norm() / bf16().float().norm()).item()
        int4_ms, bf16_ms = do_bench_cudagraph(int4), do_bench_cudagraph(bf16)
        moe_int4.SMALL_CONFIG, moe_int4.LARGE_CONFIG, moe_int4.GATE_UP, moe_int4.DOWN = saved
        distinct = len(set(moe_routing.route(logits, top_k, renormalize)[1].flatten().tolist()))
        rate = [distinct * b / ms / 1e9 for b, ms in ((int4_bytes, int4_ms), (bf16_bytes, bf16_ms))]
        rows.append(f"| {tokens} | {path} | {distinct} | {int4_ms * 1e3:.1f} us ({rate[0]:.2f} TB/s) | "
                    f"{bf16_ms * 1e3:.1f} us ({rate[1]:.2f} TB/s) | {bf16_ms / int4_ms:.2f}x | "
                    f"{err:.1e} |")  # fmt: skip
        print(rows[-1], flush=True)
    print("\n| tokens | path | distinct experts | int4 layer (weights read) | bf16 layer (weights read) | "
          "int4 speed-up | rel err int4 vs bf16 |\n|---|---|---|---|---|---|---|")  # fmt: skip
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
