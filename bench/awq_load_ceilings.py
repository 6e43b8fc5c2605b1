"""Load-only ceilings of the AWQ int4 weight stream on a GPU: what the GEMV's memory access pattern alone can reach,
as a bound for the kernels in aserve/kernels/awq/ (bench/awq_bench.py times the kernels themselves):

    PYTHONPATH=. python bench/awq_load_ceilings.py --out DIR [--sections diag,tma_diag]

diag         a load-only kernel with a GEMV's tiles and grid over the AutoAWQ tensors (4096x14336)
tma_diag     the repacked weights' stream in CUDA graphs: plain loads vs TMA through shared memory (tiles per
             program, warps, pipeline stages), at the three Llama-3-8B shapes

Prints a table last; writes results.json under --out.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from awq_bench import SHAPES, graph_us, random_awq  # noqa: E402
from gpu_bench import record, run_section, write_results  # noqa: E402


def diag() -> None:
    """What the GEMV's access pattern alone can reach: a kernel that only streams the packed weights in the same
    tiles and grid (XOR-reducing them so the loads stay), inside CUDA graphs, on 4096x14336."""
    import triton
    import triton.language as tl

    @triton.jit
    def load_only(qw_ptr, out_ptr, N8, k_per_split, BLOCK_N8: tl.constexpr, BLOCK_K: tl.constexpr):
        rj = tl.program_id(0) * BLOCK_N8 + tl.arange(0, BLOCK_N8)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_K, BLOCK_N8], dtype=tl.int32)
        k_lo = tl.program_id(1) * k_per_split
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            acc ^= tl.load(qw_ptr + (k0 + rk)[:, None].to(tl.int64) * N8 + rj[None, :])
        tl.store(out_ptr + tl.program_id(1) * N8 + rj, tl.xor_sum(acc, 0))

    k, n = 4096, 14336
    sets = [random_awq(k, n)[0] for _ in range(12)]
    out = torch.empty(k, n // 8, dtype=torch.int32, device="cuda")
    rows = []
    for block_n, block_k, tiles, warps in itertools.product((128, 256, 512), (32, 64, 128), (1, 4), (4, 8)):
        split = k // (block_k * tiles)

        def run(qw, bn=block_n, bk=block_k, sp=split, w=warps):
            load_only[(n // bn, sp)](qw, out, n // 8, k // sp, BLOCK_N8=bn // 8, BLOCK_K=bk, num_warps=w)

        us = graph_us(run, [(q,) for q in sets])
        rows.append((us, block_n, block_k, tiles, warps))
    rows.sort()
    for us, block_n, block_k, tiles, warps in rows[:6]:
        print(f"   load-only BN={block_n} BK={block_k} tiles={tiles} warps={warps}: {us:.1f} us = "
              f"{k * n / 2 / us / 1e6:.2f} TB/s", flush=True)  # fmt: skip
    us, block_n, block_k, tiles, warps = rows[0]
    record(
        "diag_load_only_4096x14336",
        round(k * n / 2 / us / 1e6, 2),
        "TB/s",
        f"BN={block_n} BK={block_k} tiles={tiles} warps={warps}: {us:.1f} us (the GEMV's ceiling with this tiling)",
    )


def tma_diag() -> None:
    """Load-only ceilings of the repacked weights' stream (8 KB tiles, `tiles` consecutive ones per program) in CUDA
    graphs: plain 16-byte loads vs TMA (a host tensor descriptor over [tiles * 8, 256] int32, Triton's pipeliner
    keeping num_stages tiles in flight through shared memory). The question: does a deeper pipeline through shared
    memory stream faster than the GEMV's registers can (load-only with plain loads: ~3.3 TB/s at 29 MB)?"""
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def tma_load_only(desc, out_ptr, tiles, NUM_STAGES: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([8, 256], tl.int32)
        for t in tl.range(0, tiles, num_stages=NUM_STAGES):
            acc ^= desc.load([(pid * tiles + t) * 8, 0])
        tl.store(out_ptr + pid * 256 + tl.arange(0, 256), tl.xor_sum(acc, 0))

    @triton.jit
    def plain_load_only(w_ptr, out_ptr, tiles, NUM_STAGES: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, 8)[:, None] * 256 + tl.arange(0, 256)[None, :]
        acc = tl.zeros([8, 256], tl.int32)
        base = w_ptr + pid.to(tl.int64) * tiles * 2048
        for t in tl.range(0, tiles, num_stages=NUM_STAGES):
            acc ^= tl.load(base + t * 2048 + offs)
        tl.store(out_ptr + pid * 256 + tl.arange(0, 256), tl.xor_sum(acc, 0))

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print("\n| K x N | MB | plain loads: best us (TB/s), config | TMA: best us (TB/s), config |")
    print("|---|---|---|---|")
    for k, n in SHAPES:
        words = k * n // 8  # int32 words of the packed weights
        copies = max(4, int(400e6 // (4 * words)))
        ws = [torch.randint(-(2**31), 2**31 - 1, (words // 256, 256), dtype=torch.int32, device="cuda")
              for _ in range(copies)]  # fmt: skip
        descs = [TensorDescriptor.from_tensor(w, [8, 256]) for w in ws]
        out = torch.empty(words // 2048 * 256, dtype=torch.int32, device="cuda")
        best = {}
        for name, kernel, args in (("plain", plain_load_only, ws), ("tma", tma_load_only, descs)):
            rows = []
            for tiles, warps, stages in itertools.product((2, 4, 8, 16), (1, 2, 4), (1, 2, 3, 4)):
                programs = words // 2048 // tiles

                def run(a, kn=kernel, t=tiles, w=warps, st=stages, p=programs):
                    kn[(p,)](a, out, t, NUM_STAGES=st, num_warps=w)

                try:
                    rows.append((graph_us(run, [(a,) for a in args]), tiles, warps, stages))
                except Exception as e:  # noqa: BLE001  (out of resources)
                    print(f"   {name} tiles {tiles} warps {warps} stages {stages}: {type(e).__name__}", flush=True)
            rows.sort()
            for us, tiles, warps, stages in rows[:3]:
                print(f"   {name} {k}x{n} tiles {tiles} warps {warps} stages {stages}: {us:.2f} us "
                      f"({4 * words / us / 1e6:.2f} TB/s)", flush=True)  # fmt: skip
            best[name] = rows[0]
        cells = [f"{b[0]:.2f} ({4 * words / b[0] / 1e6:.2f}), {b[1]} tiles / {b[2]} warps / {b[3]} stages"
                 for b in (best["plain"], best["tma"])]  # fmt: skip
        print(f"| {k}x{n} | {4 * words / 1e6:.1f} | {cells[0]} | {cells[1]} |", flush=True)
        record(f"tma_diag_{k}x{n}", round(best["tma"][0], 2), "us", f"plain loads {best['plain'][0]:.2f} us")
        del ws, descs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="diag,tma_diag")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    run = {"diag": diag, "tma_diag": tma_diag}
    for name in args.sections.split(","):
        run_section(name, run[name])
    write_results(args.out)


if __name__ == "__main__":
    main()
