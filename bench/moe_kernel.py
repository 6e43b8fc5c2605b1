"""The fused MoE kernel (aserve/kernels/moe.py) on the GPU, bf16, random weights and router logits:

    python bench/moe_kernel.py [--shape qwen3-30b-a3b|mixtral-8x7b] [--tokens 2048] [--tune] [--fp8]

For each of `--tokens` (comma-separated) tokens: the two grouped GEMMs (gate/up with SiLU·mul, down with the routing
weights) against cuBLAS doing the same FLOPs as two dense bf16 matmuls (every routed row through one weight: [T k,
H] x [H, 2 I] and [T k, I] x [I, H]); the ratio is the grouped GEMMs' share of the dense rate (issue 27's target: >=
60 % at 2,048 tokens). Also the routing (route_and_align), the whole layer (fused_moe: routing, GEMMs, the sum over
top_k), its error against the per-expert torch path, and batch-1 decode (one token: its top_k experts' weights read,
against copy bandwidth); the GEMMs again with SHRINK 0, 1 and 2 (blocks of few routed rows through half- or
quarter-height tiles) and with GROUP_M 1 (programs in row-block order). `--tune` times a grid of launch
configurations at both sizes first and uses the best. `--fp8`: the experts in e4m3 with row scales (`--quantization
fp8`'s experts: aserve/layers/quantization/fp8_moe.py), the activations rounded to e4m3 per row past
fp8_gemv.MAX_ROWS tokens (FP8 MMAs), 16-bit below; the error is then against the per-expert path on the dequantised
experts. Where torch._grouped_mm runs bf16 experts (aserve/kernels/moe_grouped_mm.py available), the same for its
path: its two GEMMs, the routing and sort, the whole layer. Prints a table."""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from gpu_bench import bench_ms
from triton.testing import do_bench_cudagraph

from aserve.kernels import fp8_gemv, fused, moe, moe_align, moe_grouped_mm
from aserve.kernels.fp8_reference import dequantize
from aserve.layers.moe import FusedMoE, per_expert_matmuls
from aserve.layers.quantization.fp8 import quantize_per_channel

SHAPES = {  # experts, top_k, hidden, expert intermediate, renormalise
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}


def random_experts(shape: str, fp8: bool):
    """The shape's experts, random bf16 on the GPU (seed 0), or rounded to e4m3 with row scales -> (w13, w2, (w13
    scales, w2 scales) or (None, None), a FusedMoE block holding the experts' values in bf16 for references)."""
    experts, top_k, hidden, inter, renormalize = SHAPES[shape]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dt) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dt) * inter**-0.5
    layer = FusedMoE(experts, top_k, hidden, inter, renormalize).to(dev, dt)
    layer.w13.data, layer.w2.data = w13, w2
    if not fp8:
        return w13, w2, (None, None), layer
    (q13, s13), (q2, s2) = quantize_per_channel(w13), quantize_per_channel(w2)
    layer.w13.data, layer.w2.data = dequantize(q13, s13, dt), dequantize(q2, s2, dt)
    return q13, q2, (s13, s2), layer


def routed(x, logits, w13, w2, top_k, renormalize, block_m, w13_scale=None, w2_scale=None):
    """The routing done once, and the two grouped GEMMs on it as functions of their tiles. FP8 experts past
    fp8_gemv.MAX_ROWS tokens: the activations rounded to e4m3 per row once here, as fused_moe does before each GEMM."""
    weights, _, sorted_slots, block_experts = moe_align.route_and_align(logits, top_k, renormalize, block_m)
    n = x.shape[0] * top_k
    act = torch.empty(n, w2.shape[2], dtype=x.dtype, device=x.device)
    out = torch.empty(n, x.shape[1], dtype=x.dtype, device=x.device)
    a, a_scale, act_q, act_scale = x, None, act, None
    if w13_scale is not None and x.shape[0] > fp8_gemv.MAX_ROWS:
        (a, a_scale), (act_q, act_scale) = moe._per_token(x), moe._per_token(act.normal_())
    return {
        "gate_up": lambda cfg: moe.grouped_gemm(a, w13, act, sorted_slots, block_experts, block_m, cfg, top_k, True,
                                                b_scale=w13_scale, a_scale=a_scale),
        "down": lambda cfg: moe.grouped_gemm(act_q, w2, out, sorted_slots, block_experts, block_m, cfg, 1, False,
                                             weights, w2_scale, act_scale),
    }  # fmt: skip


def tune(x, w13, w2, logits, top_k, renormalize, scales=(None, None)) -> dict:
    """The fastest launch configuration on a grid: for each BLOCK_M (16 for a decode-sized batch), each GEMM's
    fastest tiles."""
    decode = x.shape[0] * top_k <= w13.shape[0]
    if decode:
        block_ms, grid = (16,), list(itertools.product((32, 64, 128), (128, 256), (4,), (3, 4), (1,)))
    else:
        block_ms, grid = (64, 128), list(itertools.product((128, 256), (64, 128), (4, 8), (3, 4), (8,)))
    best = None
    for block_m in block_ms:
        gemms = routed(x, logits, w13, w2, top_k, renormalize, block_m, *scales)
        chosen, total = {"BLOCK_M": block_m}, 0.0
        for which, run in gemms.items():
            fastest = None
            for bn, bk, warps, stages, group in grid:
                tiles_per_stage = block_m * bk + (2 if which == "gate_up" else 1) * bk * bn
                if tiles_per_stage * 2 * stages > 220_000:  # past the shared memory
                    continue
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages)
                try:
                    ms = bench_ms(lambda: run(cfg), 10, 40)
                except Exception as e:  # out of resources
                    print(f"   {which} {cfg}: {type(e).__name__}")
                    continue
                if fastest is None or ms < fastest[0]:
                    fastest = (ms, cfg)
            print(f"   BLOCK_M {block_m} {which}: {fastest[0] * 1e3:.0f} us {fastest[1]}", flush=True)
            chosen[which] = fastest[1]
            total += fastest[0]
        if best is None or total < best[0]:
            best = (total, chosen)
    return best[1]


def library_rows(tokens, x, logits, w13, w2, top_k, renormalize, layer, dense_ms) -> dict:
    """moe_grouped_mm's path at every size: its two GEMMs (torch._grouped_mm), the routing and sort, the whole layer
    (CUDA graph), its error."""
    weights, xs, pos, offs = moe_grouped_mm.sort_by_expert(x, logits, top_k, renormalize)
    act = fused.silu_and_mul(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
    up_ms = bench_ms(lambda: torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
    down_ms = bench_ms(lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=offs))
    sort_ms = do_bench_cudagraph(lambda: moe_grouped_mm.sort_by_expert(x, logits, top_k, renormalize))
    run = functools.partial(moe_grouped_mm.library_moe, x, logits, w13, w2, top_k, renormalize)
    layer_ms = do_bench_cudagraph(run)
    ref = per_expert_matmuls(layer, x, logits).float()
    err = ((run().float() - ref).norm() / ref.norm()).item()
    return {
        f"{tokens} tok: torch._grouped_mm gate_up / down": f"{up_ms * 1e3:.1f} / {down_ms * 1e3:.1f} us, "
        f"{100 * dense_ms / (up_ms + down_ms):.0f} % of the dense rate",
        f"{tokens} tok: moe_grouped_mm route and sort (CUDA graph)": f"{sort_ms * 1e3:.1f} us",
        f"{tokens} tok: moe_grouped_mm whole layer (CUDA graph)": f"{layer_ms * 1e3:.1f} us, rel err {err:.1e}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--tokens", default="2048", help="comma-separated token counts (one token is always timed too)")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--fp8", action="store_true", help="e4m3 experts with row scales")
    args = p.parse_args()
    experts, top_k, hidden, inter, renormalize = SHAPES[args.shape]
    dev, dt = "cuda", torch.bfloat16
    w13, w2, scales, layer = random_experts(args.shape, args.fp8)
    rows = {}
    print(f"{torch.cuda.get_device_name()}, {args.shape}: E={experts} top_k={top_k} H={hidden} I={inter}", flush=True)

    library = not args.fp8 and moe_grouped_mm.available(w13)
    for tokens in [int(t) for t in args.tokens.split(",")] + [1]:
        x = torch.randn(tokens, hidden, device=dev, dtype=dt)
        logits = torch.randn(tokens, experts, device=dev, dtype=dt)
        cfg = moe.moe_config(tokens * top_k, experts)
        if args.tune:
            print(f"== tuning at {tokens} tokens", flush=True)
            cfg = tune(x, w13, w2, logits, top_k, renormalize, scales)
        gemms = routed(x, logits, w13, w2, top_k, renormalize, cfg["BLOCK_M"], *scales)
        up_ms, down_ms = (bench_ms(lambda: gemms[w](cfg[w])) for w in ("gate_up", "down"))
        route_ms = do_bench_cudagraph(lambda: moe_align.route_and_align(logits, top_k, renormalize, cfg["BLOCK_M"]))
        layer_ms = do_bench_cudagraph(lambda: moe.fused_moe(x, logits, w13, w2, top_k, renormalize, cfg, *scales))
        ref = per_expert_matmuls(layer, x, logits).float()
        got = moe.fused_moe(x, logits, w13, w2, top_k, renormalize, cfg, *scales).float()
        err = ((got - ref).norm() / ref.norm()).item()
        rows[f"{tokens} tok: config"] = str(cfg)
        rows[f"{tokens} tok: route_and_align (CUDA graph)"] = f"{route_ms * 1e3:.1f} us"
        rows[f"{tokens} tok: fused_moe (whole layer, CUDA graph)"] = (f"{layer_ms * 1e3:.1f} us, rel err vs "
                                                                      f"per-expert matmuls {err:.1e}")  # fmt: skip
        m = tokens * top_k
        if tokens > 1:
            flops = (2 * m * hidden * 2 * inter, 2 * m * inter * hidden)
            dense = [(torch.randn(m, kk, device=dev, dtype=dt), torch.randn(kk, nn, device=dev, dtype=dt))
                     for kk, nn in ((hidden, 2 * inter), (inter, hidden))]  # fmt: skip
            dense_ms = [bench_ms(lambda: a @ b) for a, b in dense]
            for name, ms, d_ms, f in zip(("gate_up", "down"), (up_ms, down_ms), dense_ms, flops):
                rows[f"{tokens} tok: {name} grouped GEMM vs dense"] = (
                    f"{ms * 1e3:.1f} us ({f / ms / 1e9:.0f} TFLOP/s) vs {d_ms * 1e3:.1f} us ({f / d_ms / 1e9:.0f})"
                )
            rate = 100 * sum(dense_ms) / (up_ms + down_ms)
            rows[f"{tokens} tok: grouped / dense rate"] = f"{rate:.0f} % (target >= 60 %)"
            # blocks of few routed rows through shorter tiles (moe.py's SHRINK); programs in row-block order
            for variant in ({"SHRINK": 0}, {"SHRINK": 1}, {"SHRINK": 2}, {"GROUP_M": 1}):
                shrunk = {**cfg, **{w: {**cfg[w], **variant} for w in ("gate_up", "down")}}
                ms = [bench_ms(lambda: gemms[w](shrunk[w])) for w in ("gate_up", "down")]
                same = torch.equal(moe.fused_moe(x, logits, w13, w2, top_k, renormalize, shrunk, *scales).float(), got)
                rows[f"{tokens} tok: gate_up / down with {variant}"] = (
                    f"{ms[0] * 1e3:.1f} / {ms[1] * 1e3:.1f} us, {100 * sum(dense_ms) / sum(ms):.0f} % of the dense "
                    f"rate, output {'the same' if same else 'DIFFERENT'}"
                )
            if library:
                rows.update(library_rows(tokens, x, logits, w13, w2, top_k, renormalize, layer, sum(dense_ms)))
        else:
            src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            bw = 2 * src.numel() / bench_ms(lambda: dst.copy_(src)) / 1e9  # TB/s, bytes read + written
            active = top_k * (w13[0].numel() + w2[0].numel()) * w13.element_size()
            gemm_ms = up_ms + down_ms
            rows["1 tok: grouped GEMMs"] = (f"{gemm_ms * 1e3:.1f} us, {active / gemm_ms / 1e9:.2f} TB/s of the "
                                            f"{top_k} experts' weights (copy {bw:.2f} TB/s)")  # fmt: skip
    print("\n| result | value |\n|---|---|")
    for key, value in rows.items():
        print(f"| {key} | {value} |")


if __name__ == "__main__":
    main()
