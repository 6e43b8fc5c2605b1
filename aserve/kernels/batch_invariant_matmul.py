"""Batch-invariant matmul (deterministic mode's GPU linear layers): y [M, N] = x [M, K] W^T (+ bias), W [N, K]
row-major as nn.Linear keeps it, each output element summed in one order that does not depend on M.

cuBLAS picks its kernel (tile shape, split-K, stream-K) by the problem's shape, M included, and the Triton GEMV runs
one-row inputs; each sums a row's products in another order, so a request's logits changed with the batch around it.
Here the tile shape (BLOCK_M x BLOCK_N, BLOCK_K steps, warps) is chosen once per weight from N and K alone
(`config_for`), there is no split-K, and every program sums its tile over K in the same BLOCK_K steps into a float32
accumulator: an output element's value depends on its row of x, the weight and the tile shape only. Rows past M are
loaded as zeros and not stored; programs are ordered in groups of GROUP_M row blocks for L2 reuse (which changes
nothing in any sum). Reference: torch.nn.functional.linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl

# Decode batches (a few rows) are bound by streaming W: small column blocks give enough programs to fill the GPU
# from the weight alone; wide layers take wider blocks.
_NARROW = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
_WIDE = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
_WIDE_N = 16384


def config_for(n: int, k: int) -> dict:
    """The launch configuration of a [n, k] weight: from its shape alone, never from the rows of x."""
    return dict(_WIDE if n >= _WIDE_N else _NARROW)


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.gdc_sync(USE_PDL)
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk + k0 < K
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None):
    """x [M, K] (rows with unit stride), weight [N, K] contiguous, bias [N] or None -> x @ weight^T + bias [M, N] in
    x's dtype. `config`: config_for(N, K) unless given (it must not depend on M for batch invariance)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    cfg = config or config_for(n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _matmul_kernel[grid](
        x, weight, weight if bias is None else bias, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], IEEE=x.dtype == torch.float32, USE_PDL=pdl.ENABLED, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl.launch_kwargs(),
    )  # fmt: skip
    return y
