"""Probe (issue #7, session 16): the M = 1 repacked GEMV with its K split inside a thread-block cluster, the split's
sum a cross-CTA reduction through distributed shared memory (Triton >= 3.7: num_ctas > 1 with a reduction over
the axis split across the cluster's CTAs) instead of the float32 partials, fence, counter atomic and the last
program's reload (the split-K tail, 1.1-2.0 us per GEMV: docs/benchmarks.md, session 14 run 8).

Program (pid_n) = a cluster of CL CTAs over column block pid_n; CTA g takes K tiles g * tiles .. + tiles, so
CL * tiles must be all of K's tiles (no split beyond the cluster). One warp per CTA, the same loads, unpacking and
multiply-adds as kernels/awq.py's _awq_gemv1_repacked_kernel (its helpers).

    python3 bench/awq_cluster_probe.py ptx     # compile for sm_90 here (no GPU; JOINED=1: the joined reduction)
    python3 bench/awq_cluster_probe.py run     # on a GPU: check against the reference, time vs the kernel

Triton 3.6 (the device image's, pinned by its torch 2.11) rejects a reduction across CTAs (ReduceOpToLLVM asserts
isReduceWithinCTA); Triton 3.9 (what torch 2.13 installs here) compiles it. Session 16 carried 3.9 to the device: the
cp312 wheel's triton/ without backends/amd, libproton, cupti, nvdisasm and ptxas-blackwell, libtriton.so stripped
(--strip-unneeded), as a 51 MB tar.xz in an excluded folder `.t39` (carry [".whl", ".t39"]), then

    tar -xJf .t39/triton39.tar.xz -C /tmp/t39
    PYTHONPATH=/tmp/t39:/tmp/site:$PWD/bench:$PWD TRITON_BACKENDS_IN_TREE=1 \
        TRITON_PTXAS_BLACKWELL_PATH=/tmp/t39/triton/backends/nvidia/bin/ptxas python3 bench/awq_cluster_probe.py run
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(os.path.dirname(__file__), "..")]

from kernels import awq, pdl  # noqa: E402
from kernels.awq import _column_sums, _load_repacked, _load_x_pairs, _repacked_tile  # noqa: E402


@triton.jit
def _cluster_sums(c, CL: tl.constexpr, JOINED: tl.constexpr):
    """c (8 float32 [CL * 8, 16], column 8j + c in the c-th; rows 8g .. 8g + 7 in CTA g) summed over rows, i.e.
    over the cluster -> [128]. JOINED False: kernels/awq.py's _column_sums, eight [16] reductions, each across the
    cluster (session 16 runs 6-7); True: the eight joined first (a new minor axis), one reduction across the
    cluster, reshaped to column order after it (Triton 3.9 still synchronises the join's layout conversions with
    cluster barriers: 9 barrier.cluster.wait in the PTX as well)."""
    if JOINED:
        y = tl.join(tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6])),
                    tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7])))  # fmt: skip
        return tl.reshape(tl.sum(y, 0), [128])  # [CL * 8, 16, 2, 2, 2] -> [16, 2, 2, 2] -> [128]
    else:
        return _column_sums(c, 16)


@triton.jit
def _cluster_gemv1_kernel(x_ptr, wq_ptr, meta_ptr, out_ptr, KT, tiles, CL: tl.constexpr, X_BF16: tl.constexpr,
                          ASM: tl.constexpr, USE_PDL: tl.constexpr, NOREDUCE: tl.constexpr = False,
                          JOINED: tl.constexpr = False):  # fmt: skip
    """2D tensors [CL * 8, 16] as the one-CTA kernel's [8, 16]: rows 8g + i are row i of CTA g's tiles (Triton
    splits the first axis across the cluster's CTAs)."""
    pid_n = tl.program_id(0)
    r = tl.arange(0, CL * 8)[:, None]
    jv = tl.arange(0, 16)[None, :]
    t0 = (r // 8) * tiles  # [CL * 8, 1]: the CTA's first tile
    iv = r % 8
    woff = (pid_n * KT + t0) * 2048 + iv * 16 + jv  # [CL * 8, 16]
    moff = (pid_n * KT + t0) * 128 + jv  # [CL * 8, 16] (the same meta words for a CTA's 8 rows: L1 hits)
    xoff = t0 * 64 + iv * 8 + 0 * jv  # [CL * 8, 16]: the loads' layout for every operand
    one = tl.full([1, 1], 1, tl.int1)
    w = _load_repacked(wq_ptr, meta_ptr, woff, moff, one)
    pdl.gdc_sync(USE_PDL)
    xp = _load_x_pairs(x_ptr, xoff, one)
    zero = tl.zeros([CL * 8, 16], dtype=tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero)
    for t in range(tiles):
        more = one & (t + 1 < tiles)
        w_next = _load_repacked(wq_ptr + (t + 1) * 2048, meta_ptr + (t + 1) * 128, woff, moff, more)
        xp_next = _load_x_pairs(x_ptr + (t + 1) * 64, xoff, more)
        c = _repacked_tile(c, w, xp, X_BF16, ASM)
        w = w_next
        xp = xp_next
    if NOREDUCE:  # diagnosis (wrong output): each CTA stores its rows' sums, no cross-CTA reduction
        tl.store(out_ptr + pid_n * CL * 128 + r * 16 + jv, c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7])
    else:
        y = _cluster_sums(c, CL, JOINED)
        tl.store(out_ptr + pid_n * 128 + tl.arange(0, 128), y.to(out_ptr.dtype.element_ty))


def cluster_gemv(x, packed, cl: int, noreduce: bool = False, joined: bool = False) -> torch.Tensor:
    k, n = packed.in_features, packed.out_features
    kt, nb = k // awq.REPACK_GROUP, n // 128
    assert x.shape[0] == 1 and kt % cl == 0
    out = torch.empty(1, n * cl if noreduce else n, dtype=torch.float32 if noreduce else x.dtype, device=x.device)
    _cluster_gemv1_kernel[(nb,)](x.view(torch.int32), packed.wq, packed.meta, out, kt, kt // cl, CL=cl,
                                 X_BF16=x.dtype == torch.bfloat16, ASM=not awq._INTERPRETED, USE_PDL=pdl.ENABLED,
                                 NOREDUCE=noreduce, JOINED=joined, num_warps=1, num_stages=1, num_ctas=cl,
                                 **pdl.launch_kwargs())  # fmt: skip
    return out


def ptx() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _cluster_gemv1_kernel
    for cl in (1, 4, 8, 16):
        sig = {"x_ptr": "*i32", "wq_ptr": "*i32", "meta_ptr": "*i32", "out_ptr": "*bf16", "KT": "i32", "tiles": "i32",
               "CL": "constexpr", "X_BF16": "constexpr", "ASM": "constexpr", "USE_PDL": "constexpr",
               "NOREDUCE": "constexpr", "JOINED": "constexpr"}  # fmt: skip
        consts = {"CL": cl, "X_BF16": True, "ASM": True, "USE_PDL": True, "NOREDUCE": False, "JOINED": os.environ.get("JOINED") == "1"}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("x_ptr", "wq_ptr", "meta_ptr", "out_ptr")}
        src = ASTSource(fn, sig, {(fn.arg_names.index(a),): v for a, v in consts.items()}, attrs)
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, num_stages=1,
                                                                                     num_ctas=cl))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            print(f"CL={cl}: compile failed: {str(e)[-600:]}")
            continue
        text = k.asm["ptx"]
        ops = sorted({w for line in text.splitlines() for w in line.split()
                      if ("cluster" in w or "mapa" in w) and "_cluster_gemv1" not in w
                      and not w.startswith(("awq", '"'))})  # fmt: skip
        body = text[text.find("Inner Loop Header"):]
        body = body[: body.find("_crit_edge")]
        print(f"CL={cl}: {text.count('barrier.cluster.wait')} cluster waits, {text.count('ld.global')} ld.global, {text.count('st.global')} st.global, "
              f"{text.count('ld.shared::cluster')} ld.shared::cluster, loop {body.count(chr(10))} lines, "
              f"{body.count('bar.sync')} bar.sync in it; {ops}")  # fmt: skip
        with open(f"/tmp/cluster_cl{cl}.ptx", "w") as f:
            f.write(text)


def run() -> None:
    from awq_bench import GROUP, awq_bytes, graph_us, random_awq

    from kernels.awq_reference import dequantize

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    # (K, N, cluster sizes): 4096x4096 (32 K tiles), 4096x14336 (32), 14336x4096 (112)
    for k, n, cls in [(4096, 4096, (4, 8)), (4096, 14336, (4, 8)), (14336, 4096, (8,))]:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        qs = [random_awq(k, n)[:3] for _ in range(max(4, int(400e6 // awq_bytes(k, n))))]
        ps = [(x, awq.awq_repack(*q, GROUP)) for q in qs]
        ref = x.float() @ dequantize(*qs[0], GROUP).float()
        for use_pdl in (True, False):
            pdl.enable(use_pdl)
            try:
                base = graph_us(lambda x, p: awq.awq_gemv_repacked(x, p), ps)
                cells = [f"PDL {int(use_pdl)} base {base:.2f}"]
                for cl in cls:
                    try:
                        out = cluster_gemv(x, ps[0][1], cl).float()
                        err = ((out - ref).abs().max() / ref.abs().max()).item()
                        t = graph_us(lambda x, p, cl=cl: cluster_gemv(x, p, cl), ps)
                        t0 = graph_us(lambda x, p, cl=cl: cluster_gemv(x, p, cl, True), ps)
                        out = cluster_gemv(x, ps[0][1], cl, joined=True).float()
                        err_j = ((out - ref).abs().max() / ref.abs().max()).item()
                        tj = graph_us(lambda x, p, cl=cl: cluster_gemv(x, p, cl, joined=True), ps)
                        cells.append(f"CL={cl}: {t:.2f}, joined {tj:.2f}, no reduce {t0:.2f} (err {err:.1e} / "
                                     f"{err_j:.1e})")  # fmt: skip
                    except Exception as e:  # noqa: BLE001
                        cells.append(f"CL={cl}: failed {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    print(f"  {k}x{n} {cells[-1]}", flush=True)
            finally:
                pdl.enable(False)
            rows.append(f"| {k}x{n} | " + " | ".join(cells) + " |")
        del ps, qs
    print("\n| K x N | us (graphs + PDL) |\n|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    {"ptx": ptx, "run": run}[sys.argv[1] if len(sys.argv) > 1 else "run"]()
