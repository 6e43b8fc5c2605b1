"""The Triton matmul over 8-bit weights (int8, float8 e4m3) with one float32 scale per output channel: y = (x w^T) *
scale (+ bias), w [N, K] row-major (nn.Linear's layout), x in 16 bits or float32. The weight tiles are widened in
registers to x's dtype (exact: |q| <= 127 and every e4m3 value are bf16 and fp16 values) for tl.dot, accumulated in
float32; the scales and bias are applied in the epilogue. Used by aserve/kernels/int8.py (int8_matmul) and
aserve/kernels/fp8_gemv.py (fp8_matmul), each with its own launch configurations.

Programs walk the output in groups of GROUP_M row blocks (consecutive programs share weight tiles, read from L2).
EVICT_FIRST marks the weight loads evict-first (at few rows each weight tile is read once). SPLIT_K > 1 splits K
over that many programs per output tile (more programs in flight where the tiles are few, as at few rows); their
float32 partials (scaled) are summed in a fixed order by aserve/kernels/awq/split_k.py's split_k_reduce, so results
are the same at every run. Float32 x takes full-precision dot products (IEEE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.awq.split_k import split_k_reduce


@triton.jit
def _scaled_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os, tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EVICT_FIRST: tl.constexpr, PARTIAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # GROUP_M row blocks walk the column blocks together: consecutive programs share weight tiles
    group = pid // (GROUP_M * blocks_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % group_m
    pid_n = (pid % (GROUP_M * blocks_n)) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    k_start = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl.gdc_sync(USE_PDL)
    for k_tile in range(k_start, k_end, BLOCK_K):
        k0 = tl.multiple_of(k_tile, BLOCK_K)  # slices start on whole tiles: aligned (16-byte) loads
        k_ok = rk + k0 < K
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if EVICT_FIRST:
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    out_ptrs = out_ptr + pid_k * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    if PARTIAL:  # float32 partials [SPLIT_K, M, N]; split_k_reduce adds the bias
        tl.store(out_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def scaled_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, cfg: dict,
                  evict_first: bool = False) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> (x w^T) * scale (+ bias) [M, N] in x's dtype; w int8 or e4m3 [N, K], scale float32 [N]; cfg:
    BLOCK_M / BLOCK_N / BLOCK_K / GROUP_M / num_warps / num_stages and optionally SPLIT_K (default 1)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(-1) == 1 and w.stride(-1) == 1 and w.element_size() == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(k, cfg["BLOCK_K"])
    tiles_per_split = triton.cdiv(tiles, max(1, min(cfg.get("SPLIT_K", 1), tiles)))
    split_k = triton.cdiv(tiles, tiles_per_split)  # no empty slice
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    _scaled_matmul_kernel[grid](
        x, w, scale, bias if bias is not None else scale, target, m, n, k, x.stride(0), w.stride(0),
        target.stride(-2), target.stride(0) if split_k > 1 else 0, tiles_per_split,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, EVICT_FIRST=evict_first, PARTIAL=split_k > 1,
        USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split_k > 1:
        split_k_reduce(target, bias, out)
    return out
