"""Launch configurations and dispatch thresholds of the AWQ kernels, in one place. The launchers read them at call
time (`tuning.GEMV1_CONFIG`), so bench/awq_bench.py's tuning sections and the tests set them here
(`tuning.GEMV1_CONFIG = ...`, `monkeypatch.setattr(tuning, ...)`). Chosen on an H200 (bench/awq_bench.py --sections
tune, tune_repacked, repacked_rows; docs/benchmarks.md, "AWQ int4")."""

from __future__ import annotations

import functools

import torch

GEMV_MAX_M = 16  # more rows: dequantise + cuBLAS
F16X2_DTYPES = (torch.float16, torch.bfloat16)  # float32 activations take the tl.dot kernel (f16 would round them)

# -- over the AutoAWQ tensors -----------------------------------------------------------------------------------
# M = 1 (f16x2): BLOCK_N columns and TILES K tiles of BLOCK_K rows per program, R rows per asm call (overflow: see
# aserve/kernels/awq/f16x2.py); TILES None: 4 or 2 where that leaves GEMV1_MIN_PROGRAMS programs (one warp each),
# else 1. The fastest of the configurations tried on an H200 (docs/benchmarks.md, "What was tried: AWQ kernels"):
# rows of 64 bytes per program (BLOCK_N 128), 4 tiles for 4096x14336 and 14336x4096 (896 programs), 2 for
# 4096x4096 (512).
GEMV1_CONFIG = dict(BLOCK_N=128, BLOCK_K=128, R=16, TILES=None, num_warps=1, num_stages=1)
GEMV1_MIN_PROGRAMS = 512
DEQUANT_CONFIG = dict(BLOCK_N=256, BLOCK_K=32, num_warps=4)

# -- over awq_repack's copy -------------------------------------------------------------------------------------
# Up to REPACKED_GEMV1_MAX_M rows (fp16 / bf16) the f16x2 kernel, REPACKED_GEMV1_ROWS rows per program (2: each
# weight unpacked once for both); more rows: tl.dot. H200, CUDA graphs (docs/benchmarks.md, "AWQ kernel speed"): two
# rows per program beat one at M = 4 (9.9 / 25.5 / 26.2 vs 11.5 / 31.9 / 32.4 us), both beat tl.dot up to M = 6.
REPACKED_GEMV1_MAX_M = 6
REPACKED_GEMV1_ROWS = 2
REPACKED_GEMV1_PER_SM = 8  # one-row programs per SM in one wave (gemv1_repacked._repacked_tiles_m1)
# tl.dot kernel: bench section tune_repacked (209.8 us summed over M 4 + 16 and the three shapes; the best without
# SWAP 215.1 us, BP 64 / 4 warps / 3 stages without SWAP > 238.3 us)
REPACKED_DOT_CONFIG = dict(BP=64, num_warps=4, num_stages=1, SWAP=True)
REPACKED_DEQUANT_CONFIG = dict(BP=64, num_warps=4)


@functools.cache
def _num_sms(device_index: int | None) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return 132  # interpreter: pretend an H200, so tests run the launch shapes of the GPU
