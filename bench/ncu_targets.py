"""Kernels to profile with Nsight Compute on the GPU, each launched a few times at its benchmark shape:

    ncu --clock-control none --kernel-name regex:'_awq_gemv1|_paged_attention' --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
        python bench/ncu_targets.py [--only awq,prefill]

awq      the M = 1 int4 GEMV (kernels/awq.py) on 4096 x 14336, group 128, bf16 activations
prefill  the paged attention kernel on one 4096-token causal prompt (32/8 heads, head_dim 128, bf16)
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def awq_case() -> None:
    from awq_bench import GROUP as group
    from awq_bench import random_awq

    from kernels import awq

    k, n = 4096, 14336
    qweight, qzeros, scales = random_awq(k, n, group)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        awq.awq_gemv(x, qweight, qzeros, scales, group)
    torch.cuda.synchronize()


def prefill_case() -> None:
    from gpu_bench import prefill_case as make

    from kernels.paged_attention import paged_attention

    (q, k_cache, v_cache, table, seq, qsl), _, _ = make(4096, 32, 8, 128, 16)
    for _ in range(4):
        paged_attention(q, k_cache, v_cache, table, seq, qsl, 4096)
    torch.cuda.synchronize()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="awq,prefill")
    args = p.parse_args()
    for name in args.only.split(","):
        {"awq": awq_case, "prefill": prefill_case}[name]()
