"""Experiment: an M = 1 AWQ GEMV whose tiles keep the K rows inside each thread (BLOCK_N8 = 32 lanes x warps x
int32s per lane), so no reduction crosses threads until the very end, and x * (q - z) accumulates with one FMA per
weight over a whole group before the scale is applied. Against the current kernel (default and wide configs),
inside CUDA graphs over rotating weight copies, on the three Llama-3-8B shapes (group 128).

    PYTHONPATH=. python bench/awq_gemv_experiment.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from awq_bench import GROUP, SHAPES, awq_bytes, graph_us, random_awq  # noqa: E402

from kernels import awq  # noqa: E402
from kernels.awq import _mant, _scale  # noqa: E402
from kernels.awq_reference import dequantize  # noqa: E402


@triton.jit
def _zmant(qz, qz_hi, NIB: tl.constexpr):
    if NIB < 5:
        return _mant(qz, 4 * NIB)
    else:
        return _mant(qz_hi, 4 * (NIB - 5))


@triton.jit
def _wmant(qw, qw_hi, NIB: tl.constexpr):
    if NIB < 5:
        return _mant(qw, 4 * NIB)
    else:
        return _mant(qw_hi, 4 * (NIB - 5))


@triton.jit
def _gemv1_v2_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, N, stride_os, k_per_split,
                     GROUP: tl.constexpr, BLOCK_N8: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    N8 = N // 8
    rj = pid_n * BLOCK_N8 + tl.arange(0, BLOCK_N8)
    j_ok = rj < N8
    rk = tl.arange(0, BLOCK_K)
    t0 = tl.zeros([BLOCK_N8], tl.float32)
    t1 = tl.zeros([BLOCK_N8], tl.float32)
    t2 = tl.zeros([BLOCK_N8], tl.float32)
    t3 = tl.zeros([BLOCK_N8], tl.float32)
    t4 = tl.zeros([BLOCK_N8], tl.float32)
    t5 = tl.zeros([BLOCK_N8], tl.float32)
    t6 = tl.zeros([BLOCK_N8], tl.float32)
    t7 = tl.zeros([BLOCK_N8], tl.float32)
    k_lo = pid_k * k_per_split
    for g0 in range(k_lo, k_lo + k_per_split, GROUP):
        g = g0 // GROUP
        qz = tl.load(qz_ptr + g * N8 + rj, mask=j_ok, other=0)
        qz_hi = qz >> 20
        z0 = _zmant(qz, qz_hi, 0)[None, :]
        z1 = _zmant(qz, qz_hi, 1)[None, :]
        z2 = _zmant(qz, qz_hi, 2)[None, :]
        z3 = _zmant(qz, qz_hi, 3)[None, :]
        z4 = _zmant(qz, qz_hi, 4)[None, :]
        z5 = _zmant(qz, qz_hi, 5)[None, :]
        z6 = _zmant(qz, qz_hi, 6)[None, :]
        z7 = _zmant(qz, qz_hi, 7)[None, :]
        a0 = tl.zeros([BLOCK_K, BLOCK_N8], tl.float32)
        a1 = tl.zeros([BLOCK_K, BLOCK_N8], tl.float32)
        a2 = tl.zeros([BLOCK_K, BLOCK_N8], tl.float32)
        a3 = tl.zeros([BLOCK_K, BLOCK_N8], tl.float32)
        a4 = tl.zeros([BLOCK_K, BLOCK_N8], tl.float32)
        a5 = tl.zeros([BLOCK_K, BLOCK_N8], tl.float32)
        a6 = tl.zeros([BLOCK_K, BLOCK_N8], tl.float32)
        a7 = tl.zeros([BLOCK_K, BLOCK_N8], tl.float32)
        for kk in range(0, GROUP, BLOCK_K):
            k0 = g0 + kk
            qw = tl.load(qw_ptr + (k0 + rk)[:, None].to(tl.int64) * N8 + rj[None, :], mask=j_ok[None, :], other=0)
            x = tl.load(x_ptr + k0 + rk).to(tl.float32)[:, None]
            qw_hi = qw >> 20
            a0 += x * (_wmant(qw, qw_hi, 0) - z0)
            a1 += x * (_wmant(qw, qw_hi, 1) - z1)
            a2 += x * (_wmant(qw, qw_hi, 2) - z2)
            a3 += x * (_wmant(qw, qw_hi, 3) - z3)
            a4 += x * (_wmant(qw, qw_hi, 4) - z4)
            a5 += x * (_wmant(qw, qw_hi, 5) - z5)
            a6 += x * (_wmant(qw, qw_hi, 6) - z6)
            a7 += x * (_wmant(qw, qw_hi, 7) - z7)
        s_row = s_ptr + g * N
        t0 += tl.sum(a0, 0) * _scale(s_row, rj, j_ok, 0)
        t1 += tl.sum(a1, 0) * _scale(s_row, rj, j_ok, 1)
        t2 += tl.sum(a2, 0) * _scale(s_row, rj, j_ok, 2)
        t3 += tl.sum(a3, 0) * _scale(s_row, rj, j_ok, 3)
        t4 += tl.sum(a4, 0) * _scale(s_row, rj, j_ok, 4)
        t5 += tl.sum(a5, 0) * _scale(s_row, rj, j_ok, 5)
        t6 += tl.sum(a6, 0) * _scale(s_row, rj, j_ok, 6)
        t7 += tl.sum(a7, 0) * _scale(s_row, rj, j_ok, 7)
    y = tl.join(tl.join(tl.join(t0, t2), tl.join(t1, t3)), tl.join(tl.join(t4, t6), tl.join(t5, t7)))
    y = tl.reshape(y, [BLOCK_N8 * 8])
    rn = pid_n * BLOCK_N8 * 8 + tl.arange(0, BLOCK_N8 * 8)
    tl.store(out_ptr + pid_k * stride_os + rn, y, mask=rn < N)


def gemv_v2(x, qweight, qzeros, scales, group, cfg):
    k, n8 = qweight.shape
    n = n8 * 8
    k_per_split = group * cfg["GROUPS"]
    split = k // k_per_split
    part = torch.empty(split, 1, n, dtype=torch.float32, device=x.device)
    _gemv1_v2_kernel[(triton.cdiv(n8, cfg["BN8"]), split)](
        x, qweight, qzeros, scales, part, n, part.stride(0), k_per_split, GROUP=group, BLOCK_N8=cfg["BN8"],
        BLOCK_K=cfg["BK"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    awq.split_k_reduce(part, None, out)
    return out


def main() -> None:
    torch.manual_seed(0)
    v2_configs = []
    for bn8, warps in ((64, 1), (128, 1), (128, 2), (256, 2), (256, 4), (512, 4)):
        for bk in (4, 8, 16):
            for groups in (1, 2):
                for stages in (1, 3):
                    v2_configs.append(dict(BN8=bn8, BK=bk, GROUPS=groups, num_warps=warps, num_stages=stages))
    old_configs = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_TILES=t, EACH_TILE=e, num_warps=w, num_stages=1)
                   for bn, w in ((1024, 1), (2048, 2), (4096, 4))
                   for bk in (8, 32) for t in (1, 4) for e in (True, False)]  # fmt: skip
    # correctness of v2 at full shape
    k, n = 4096, 14336
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    qw, qz, sc = random_awq(k, n)
    ref = (x.float() @ dequantize(qw, qz, sc, GROUP).float()).float()
    for cfg in v2_configs[:3]:
        out = gemv_v2(x, qw, qz, sc, GROUP, cfg).float()
        print("v2 rel err", cfg, ((out - ref).norm() / ref.norm()).item(), flush=True)
    totals: dict[str, list[float]] = {}
    base = {}
    for k, n in SHAPES:
        copies = max(4, int(400e6 // awq_bytes(k, n)))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = [(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(max(4, int(400e6 // (2 * k * n))))]
        base[(k, n)] = graph_us(F.linear, ws)
        del ws
        qs = [(x, *random_awq(k, n)) for _ in range(copies)]
        totals.setdefault("default", []).append(graph_us(lambda x_, a, b, c: awq.awq_gemv(x_, a, b, c, GROUP), qs))
        for cfg in v2_configs:
            name = "v2 " + str(cfg)
            try:
                totals.setdefault(name, []).append(
                    graph_us(lambda x_, a, b, c, cfg=cfg: gemv_v2(x_, a, b, c, GROUP, cfg), qs))
            except Exception as e:  # noqa: BLE001
                print("failed", name, type(e).__name__, str(e)[:120], flush=True)
        for c in old_configs:
            cfg = {key: v for key, v in c.items() if key != "SPLIT_TILES"}
            cfg["SPLIT_K"] = max(1, k // (c["BLOCK_K"] * c["SPLIT_TILES"]))
            name = "old " + str(c)
            try:
                totals.setdefault(name, []).append(
                    graph_us(lambda x_, a, b, q, cfg=cfg: awq.awq_gemv(x_, a, b, q, GROUP, config=cfg), qs))
            except Exception as e:  # noqa: BLE001
                print("failed", name, type(e).__name__, str(e)[:120], flush=True)
        del qs
        print(f"shape {k}x{n} done", flush=True)
    ranked = sorted((v for v in totals.items() if len(v[1]) == len(SHAPES)), key=lambda kv: sum(kv[1]))
    bf = [base[s] for s in SHAPES]
    print(f"\nbf16 cuBLAS us: {[round(b, 1) for b in bf]} (sum {sum(bf):.1f})")
    print(f"default: {[round(u, 1) for u in totals['default']]} (sum {sum(totals['default']):.1f})")
    print("\n| variant | 4096x4096 | 4096x14336 | 14336x4096 | sum us | speed-up vs bf16 per shape |\n|---|---|---|---|---|---|")
    for name, us in ranked[:15]:
        print(f"| {name} | {us[0]:.1f} | {us[1]:.1f} | {us[2]:.1f} | {sum(us):.1f} | "
              f"{', '.join(f'{b / u:.2f}x' for b, u in zip(bf, us))} |")


if __name__ == "__main__":
    main()
