"""Prefill attention tile sweep on the GPU: one 4096-token causal prompt (32/8 heads, head_dim 128, bf16),
kernels.paged_attention (the prompt's K/V from qkv rows, as the engine passes them) vs torch SDPA (flash),
TFLOP/s per launch configuration, best first.

    PYTHONPATH=. python bench/prefill_tune.py [--block-m 64,128,256] [--tile-n 32,64,128] [--warps 4,8] [--stages 2,3,4]
"""

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import prefill_case, prefill_new_kv  # noqa: E402

from kernels.paged_attention import paged_attention  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--block-m", default="64,128,256")
p.add_argument("--tile-n", default="32,64,128")
p.add_argument("--warps", default="4,8")
p.add_argument("--stages", default="2,3,4")
args = p.parse_args()
grid = [[int(x) for x in v.split(",")] for v in (args.block_m, args.tile_n, args.warps, args.stages)]
H, Hkv, D, bs, T = 32, 8, 128, 16, 4096
torch.manual_seed(0)
(q, k_cache, v_cache, table, seq, qsl), (qs, ks, vs), flops = prefill_case(T, H, Hkv, D, bs)
k_new, v_new = prefill_new_kv(q, k_cache, v_cache)  # as the engine passes a fresh prompt's K/V

def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200)


sdpa = min(bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)) for _ in range(3))
rows = []
for block_m, tile_n, warps, stages in itertools.product(*grid):
    cfg = dict(BLOCK_M=block_m, TILE_N=tile_n, num_warps=warps, num_stages=stages, REVERSE=True)
    try:
        ms = min(bench(lambda: paged_attention(q, k_cache, v_cache, table, seq, qsl, T, config=cfg, k_new=k_new,
                                               v_new=v_new)) for _ in range(2))  # fmt: skip
    except Exception as e:  # out of shared memory / registers
        print("failed", cfg, type(e).__name__, flush=True)
        continue
    rows.append((ms, cfg))
    print(f"{cfg}: {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
rows.sort(key=lambda r: r[0])
out = paged_attention(q, k_cache, v_cache, table, seq, qsl, T, k_new=k_new, v_new=v_new)
ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
print(f"relative error vs SDPA (default config): {((out.float() - ref.float()).norm() / ref.float().norm()).item():.2e}")
print(f"\nSDPA flash: {flops / sdpa / 1e9:.1f} TFLOP/s ({sdpa * 1e3:.0f} us)\n")
print("| BLOCK_M | TILE_N | warps | stages | TFLOP/s | vs SDPA |\n|---|---|---|---|---|---|")
for ms, c in rows[:8]:
    print(f"| {c['BLOCK_M']} | {c['TILE_N']} | {c['num_warps']} | {c['num_stages']} | {flops / ms / 1e9:.1f} | "
          f"{sdpa / ms:.3f}x |")
