"""The fused MoE kernel (aserve/kernels/moe.py) on the GPU, bf16, random weights and router logits:

    python bench/moe_kernel.py [--shape qwen3-30b-a3b|mixtral-8x7b] [--tokens 2048] [--tune] [--fp8]
    python bench/moe_kernel.py --variants [--smoke]

For `--tokens` tokens: the two grouped GEMMs (gate/up with SiLU·mul, down with the routing weights) against cuBLAS
doing the same FLOPs as two dense bf16 matmuls (every routed row through one weight: [T k, H] x [H, 2 I] and
[T k, I] x [I, H]); the ratio is the grouped GEMMs' share of the dense rate (issue 27's target: >= 60 % at 2,048
tokens). Also the routing (route_and_align), the whole layer (fused_moe: routing, GEMMs, the sum over top_k), its
error against the per-expert torch path, and batch-1 decode (one token: its top_k experts' weights read, against
copy bandwidth). `--tune` times a grid of launch configurations at both sizes first and uses the best. `--fp8`: the
experts in e4m3 with row scales (`--quantization fp8`'s experts: aserve/layers/quantization/fp8_moe.py), the
activations rounded to e4m3 per row past fp8_gemv.MAX_ROWS tokens (FP8 MMAs), 16-bit below; the error is then
against the per-expert path on the dequantised experts.

`--variants`: moe.py's layout against aserve/kernels/moe_sorted.py's (the gate/up GEMM's activation stored in sorted
row order, so the down GEMM reads contiguous tiles; with TMA descriptors; with x copied into sorted order first), at
BLOCK_M 128 and 64 with a few tiles for each GEMM (VARIANT_TILES), at `--tokens` tokens: each GEMM's fastest tiles,
the layer with them under a CUDA graph, its largest difference from the production default's output (relative to
that output's largest magnitude); then each variant's fastest configuration again at 256 and 1 tokens. `--smoke`
runs that on the CPU at a tiny shape in float32, for the script's own logic (with TRITON_INTERPRET=1).
Prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from gpu_bench import bench_ms
from triton.testing import do_bench_cudagraph

from aserve.kernels import fp8_gemv, moe, moe_align, moe_decode, moe_sorted
from aserve.kernels.fp8_reference import dequantize
from aserve.layers.moe import FusedMoE, per_expert_matmuls
from aserve.layers.quantization.fp8 import quantize_per_channel

SHAPES = {  # experts, top_k, hidden, expert intermediate, renormalise
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
    "tiny": (8, 2, 64, 48, True),  # --smoke
}


def random_experts(shape: str, fp8: bool, dev="cuda", dt=torch.bfloat16):
    """The shape's experts, random (seed 0; bf16 on the GPU unless told), or rounded to e4m3 with row scales ->
    (w13, w2, (w13 scales, w2 scales) or (None, None), a FusedMoE block holding the experts' values for references)."""
    experts, top_k, hidden, inter, renormalize = SHAPES[shape]
    torch.manual_seed(0)
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


VARIANTS = {  # name -> the configuration's "sorted" entry (aserve/kernels/moe_sorted.py); None: moe.py's layout
    "default": None,
    "sorted": dict(tma=False),
    "sorted+tma": dict(tma=True),
    "sorted+tma+gather": dict(tma=True, gather_x=True),
}


def tiles(block_n, block_k, warps, stages, group_m=8):
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps, num_stages=stages)


# Each GEMM's candidate tiles by BLOCK_M: around the tiles --tune chose on an H200 (BLOCK_M 128, gate/up 128 x 64 with
# 8 warps and 4 stages, down 256 x 64), with fewer stages or narrower tiles where two programs then share an SM (shared
# memory of a stage: (BLOCK_M + BLOCK_N, twice for gate/up) x BLOCK_K x 2 bytes, against 227 KiB an SM).
VARIANT_TILES = {
    128: dict(
        gate_up=[tiles(128, 64, 8, 4), tiles(128, 64, 8, 3), tiles(64, 64, 4, 4)],
        down=[tiles(256, 64, 8, 4), tiles(256, 64, 8, 3), tiles(128, 64, 8, 4), tiles(128, 64, 4, 3)],
    ),
    64: dict(
        gate_up=[tiles(128, 64, 4, 4), tiles(128, 64, 8, 4), tiles(256, 64, 8, 3), tiles(128, 32, 4, 5)],
        down=[tiles(256, 64, 4, 4), tiles(256, 64, 8, 4), tiles(128, 64, 4, 4), tiles(128, 64, 4, 6)],
    ),
}
SMOKE_TILES = {16: dict(gate_up=[tiles(16, 16, 4, 2), tiles(32, 32, 4, 2)], down=[tiles(64, 32, 4, 2)]),
               32: dict(gate_up=[tiles(64, 64, 4, 2)], down=[tiles(64, 64, 4, 2)])}  # fmt: skip


def variant_gemms(x, logits, w13, w2, top_k, renormalize, block_m, options) -> dict:
    """The routing done once and a variant's launches on it: "gate_up" / "down" as functions of their tiles, and
    "gather" (x into sorted order) where the variant has it."""
    if options is None:
        return routed(x, logits, w13, w2, top_k, renormalize, block_m)
    weights, _, sorted_slots, block_experts = moe_align.route_and_align(logits, top_k, renormalize, block_m)
    n, num_experts = x.shape[0] * top_k, w13.shape[0]
    tma, gather_x = options.get("tma", False), options.get("gather_x", False)
    gather = lambda: moe_sorted.gather_rows(x, sorted_slots, block_experts, block_m, top_k, num_experts)  # noqa: E731
    a = gather() if gather_x else x
    act = torch.empty(sorted_slots.numel(), w2.shape[2], dtype=x.dtype, device=x.device).normal_()
    out = torch.empty(n, x.shape[1], dtype=x.dtype, device=x.device)
    layout = dict(sorted_slots=sorted_slots, block_experts=block_experts, block_m=block_m, num_slots=n, tma=tma)
    gemms = {
        "gate_up": lambda cfg: moe_sorted.sorted_gemm(a, w13, act, config=cfg, row_div=top_k, a_sorted=gather_x,
                                                      out_sorted=True, gated=True, **layout),
        "down": lambda cfg: moe_sorted.sorted_gemm(act, w2, out, config=cfg, a_sorted=True, out_sorted=False,
                                                   gated=False, weights=weights, **layout),
    }  # fmt: skip
    return {**gemms, "gather": gather} if gather_x else gemms


def timer(smoke: bool):
    """ms per call of fn: CUDA-graph replays (triton's do_bench_cudagraph); --smoke: one call's wall time."""

    def wall_ms(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms if smoke else do_bench_cudagraph


def fastest_tiles(run, candidates, time_ms, label: str):
    """(ms, tiles) of the fastest candidate that runs, or None."""
    best = None
    for cfg in candidates:
        try:
            ms = time_ms(lambda: run(cfg))
        except Exception as e:  # out of resources, or a compiler's refusal: reported, the sweep goes on
            print(f"   {label} {tile_text(cfg)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        print(f"   {label} {tile_text(cfg)}: {ms * 1e3:.1f} us", flush=True)
        if best is None or ms < best[0]:
            best = (ms, cfg)
    return best


def tile_text(cfg: dict) -> str:
    return f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"


class VariantTable:
    """The rows of --variants at one shape: each a layer run under one configuration (None: the production default,
    moe.fused_moe choosing), its error against the production default's output and, where swept, its GEMMs' times."""

    def __init__(self, w13, w2, top_k: int, renormalize: bool, time_ms):
        self.w13, self.w2, self.top_k, self.renormalize, self.time_ms = w13, w2, top_k, renormalize, time_ms
        self.rows = []

    def tokens(self, x, logits) -> None:
        """The batch the next rows run: x [T, H], router logits [T, E]."""
        self.x, self.logits = x, logits
        self.production = self.layer(None)().float()

    def layer(self, cfg):
        fused_moe = moe_sorted.fused_moe if cfg is not None and "sorted" in cfg else moe.fused_moe
        return lambda: fused_moe(self.x, self.logits, self.w13, self.w2, self.top_k, self.renormalize, cfg)

    def add(self, variant: str, cfg, gemm_us: tuple = ("", "", "", "")) -> None:
        """A row: the layer under cfg timed and compared; gemm_us: (gather, gate/up, down, total) where swept."""
        run = self.layer(cfg)
        err = (run().float() - self.production).abs().max().item() / self.production.abs().max().item()
        layer_ms = self.time_ms(run)
        t, num_experts = self.x.shape[0], self.w13.shape[0]
        if cfg is None and moe_decode.use_decode(t, self.top_k, num_experts):
            tiles_text = ("", "few-token kernels", "")
        else:
            shown = cfg or moe.moe_config(t * self.top_k, num_experts)
            tiles_text = (shown["BLOCK_M"], tile_text(shown["gate_up"]), tile_text(shown["down"]))
        self.rows.append((self.x.shape[0], variant, *tiles_text, *gemm_us, f"{layer_ms * 1e3:.1f}", f"{err:.1e}"))
        print(f"-- {self.x.shape[0]} tokens, {variant} {cfg}: layer {layer_ms * 1e3:.1f} us, max rel err {err:.1e}",
              flush=True)  # fmt: skip

    def sweep(self, variant: str, options, block_m: int, candidates: dict) -> tuple | None:
        """Each GEMM's fastest of `candidates` at this BLOCK_M, then the layer with them: -> (GEMMs ms, config)."""
        print(f"== {self.x.shape[0]} tokens, {variant}, BLOCK_M {block_m}", flush=True)
        gemms = variant_gemms(self.x, self.logits, self.w13, self.w2, self.top_k, self.renormalize, block_m, options)
        best = {w: fastest_tiles(gemms[w], candidates[w], self.time_ms, w) for w in ("gate_up", "down")}
        if None in best.values():
            return None
        gather_ms = self.time_ms(gemms["gather"]) if "gather" in gemms else 0.0
        total = gather_ms + best["gate_up"][0] + best["down"][0]
        cfg = dict(BLOCK_M=block_m, gate_up=best["gate_up"][1], down=best["down"][1])
        if options is not None:
            cfg["sorted"] = options
        us = [f"{gather_ms * 1e3:.1f}" if "gather" in gemms else ""]
        self.add(variant, cfg, (*us, *(f"{ms * 1e3:.1f}" for ms in (best["gate_up"][0], best["down"][0], total))))
        return total, cfg


def compare_variants(shape: str, tokens: int, smoke: bool) -> None:
    """--variants (module docstring): one row per variant and BLOCK_M at `tokens` tokens, then each variant's fastest
    configuration at 256 and 1 tokens; the table last."""
    experts, top_k, hidden, inter, renormalize = SHAPES[shape]
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    time_ms, sweep = timer(smoke), SMOKE_TILES if smoke else VARIANT_TILES
    w13, w2, _, _ = random_experts(shape, False, dev, dt)
    started = time.perf_counter()
    device = "CPU (Triton's interpreter)" if smoke else torch.cuda.get_device_name()
    print(f"{device}, {shape}: E={experts} top_k={top_k} H={hidden} I={inter}, {dt}", flush=True)
    m = tokens * top_k
    dense = [(torch.randn(m, kk, device=dev, dtype=dt), torch.randn(kk, nn, device=dev, dtype=dt))
             for kk, nn in ((hidden, 2 * inter), (inter, hidden))]  # fmt: skip
    dense_ms = sum(time_ms(lambda a=a, b=b: a @ b) for a, b in dense)
    table = VariantTable(w13, w2, top_k, renormalize, time_ms)
    batch = lambda t: (torch.randn(t, hidden, device=dev, dtype=dt), torch.randn(t, experts, device=dev, dtype=dt))  # noqa: E731
    table.tokens(*batch(tokens))
    production = moe.moe_config(m, experts)
    gemms = variant_gemms(table.x, table.logits, w13, w2, top_k, renormalize, production["BLOCK_M"], None)
    gemm_ms = [time_ms(lambda w=w: gemms[w](production[w])) for w in ("gate_up", "down")]
    table.add("default (production)", None, ("", *(f"{ms * 1e3:.1f}" for ms in (*gemm_ms, sum(gemm_ms)))))
    fastest = {}  # variant -> (GEMMs ms, config) over the BLOCK_Ms
    for variant, options in VARIANTS.items():
        for block_m, candidates in sweep.items():
            swept = table.sweep(variant, options, block_m, candidates)
            if swept is not None and (variant not in fastest or swept[0] < fastest[variant][0]):
                fastest[variant] = swept
    for size in (256 if not smoke else 4, 1):
        table.tokens(*batch(size))
        table.add("default (production)", None)
        for variant, (_, cfg) in fastest.items():
            table.add(variant, cfg)
    print(
        f"\n{time.perf_counter() - started:.0f} s. GEMMs: each GEMM at its fastest tiles (the gather of x included); "
        f"/ dense: cuBLAS's time for the same FLOPs at {tokens} tokens ({dense_ms * 1e3:.1f} us) over the GEMMs'; "
        "max rel err: the largest difference from the production default's output over its largest magnitude\n"
    )
    print(
        "| tokens | variant | BLOCK_M | gate/up tiles | down tiles | gather us | gate/up us | down us | GEMMs us "
        "| / dense | layer us (graph) | max rel err |\n|" + "---|" * 12
    )
    for size, variant, block_m, gate_up, down, gather, up_us, down_us, total, layer_us, err in table.rows:
        rate = f"{100 * dense_ms * 1e3 / float(total):.0f} %" if total else ""
        print(
            f"| {size} | {variant} | {block_m} | {gate_up} | {down} | {gather} | {up_us} | {down_us} | {total} | "
            f"{rate} | {layer_us} | {err} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--tune", action="store_true")
    p.add_argument("--fp8", action="store_true", help="e4m3 experts with row scales")
    p.add_argument("--variants", action="store_true", help="moe.py's layout against moe_sorted.py's variants")
    p.add_argument("--smoke", action="store_true", help="--variants on the CPU, tiny shape (TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.variants or args.smoke:
        assert not args.fp8 and not args.tune, "--variants times 16-bit experts with its own grid"
        compare_variants("tiny" if args.smoke else args.shape, args.tokens if not args.smoke else 16, args.smoke)
        return
    experts, top_k, hidden, inter, renormalize = SHAPES[args.shape]
    dev, dt = "cuda", torch.bfloat16
    w13, w2, scales, layer = random_experts(args.shape, args.fp8)
    rows = {}
    print(f"{torch.cuda.get_device_name()}, {args.shape}: E={experts} top_k={top_k} H={hidden} I={inter}", flush=True)

    for tokens in (args.tokens, 1):
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
