"""awq_linear: one AWQ int4 linear layer on a GPU, the kernel picked by the number of rows M (thresholds in
aserve/kernels/awq/tuning.py).

Over awq_repack's copy (repack.py; an AWQ layer keeps only that copy where it applies: group 128, outputs a multiple
of 128):
    M <= REPACKED_GEMV1_MAX_M (fp16 / bf16)   gemv1_repacked.py's f16x2 GEMV, fused split K
    M <= 16                                   repack.py's tl.dot GEMV
    M > 16                                    repack.py's dequantise kernel, then cuBLAS
Over AutoAWQ's tensors (the other layers; autoawq.py):
    M == 1 (fp16 / bf16)                      gemv1.py's f16x2 GEMV, fused split K
    M <= 16                                   a dequantised K tile, then tl.dot
    M > 16                                    the whole weight dequantised once (awq_dequantize), then cuBLAS
float32 activations take the tl.dot kernels at M <= 16 (f16 arithmetic would round them).
"""

from __future__ import annotations

import torch

from aserve.kernels.awq import tuning
from aserve.kernels.awq.autoawq import awq_dequantize, awq_gemv
from aserve.kernels.awq.gemv1_repacked import awq_gemv_repacked
from aserve.kernels.awq.repack import RepackedAWQ, awq_dequantize_repacked, awq_gemv_repacked_dot


def awq_linear(x, qweight, qzeros, scales, group_size: int, bias=None, counters=None,
               packed: RepackedAWQ | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, in] -> [M, out]: the kernel for M (see the module docstring); `counters`: awq_gemv's; `packed`
    (awq_repack's copy of the same weights): every M runs over it, so qweight / qzeros / scales are not read then
    (after AWQLinearMethod.repack they are empty)."""
    m = x.shape[0]
    if packed is not None:
        if m <= tuning.REPACKED_GEMV1_MAX_M and x.dtype in tuning.F16X2_DTYPES:
            return awq_gemv_repacked(x, packed, bias, counters)
        if m <= tuning.GEMV_MAX_M:
            return awq_gemv_repacked_dot(x, packed, bias)
        w = awq_dequantize_repacked(packed, x.dtype)
    elif m <= tuning.GEMV_MAX_M:
        return awq_gemv(x, qweight, qzeros, scales, group_size, bias, counters=counters)
    else:
        w = awq_dequantize(qweight, qzeros, scales, group_size, x.dtype)
    return torch.addmm(bias.to(x.dtype), x, w) if bias is not None else x @ w
