"""Issue #7 experiment: the AWQ M = 1 GEMV over weights repacked once at load time (H200, CUDA graphs; results in
docs/benchmarks.md, session 10).

    PYTHONPATH=. python3 bench/awq_gemv_repack_experiment.py --out DIR [--shapes 0,1,2] [--only cur,int,rp,flat]
                                                             [--rp-set run2|run3] [--ncu W,U,LOOP,MAXNREG]

The checkpoint stays AutoAWQ's; kernels/awq.py's awq_repack builds a second copy that the M = 1 kernel reads (BN8 =
16 column groups per program):

    wq    int32 [N/8/BN8, K/128, 16, 8, BN8]: column block b, K tile t (128 rows, one group), slice r, row group i,
          column group j  <-  qweight[128 t + 16 i + r, BN8 b + j]   (a thread's 16 rows of one tile are
          consecutive, so its inputs are 8 bf16 pairs; slice [8, BN8] = 512 contiguous bytes = one warp load of
          16 bytes per thread; a program's tiles are one contiguous chunk)
    meta  int32 [N/8/BN8, K/128, 8, BN8]: per tile and column group, words 0-3 the zero points already in the form
          the f16x2 unpacking subtracts (f16x2 (1024 + z) for column pairs 0, 2 and -(64 + z) for pairs 1, 3, as
          kernels/awq.py's _ZEROS_ASM makes them), words 4-7 the scales * 16 as f16x2 pairs (2p, 2p + 1): 32 bytes
          per 1024 weights, read with 16-byte loads next to the weights (AutoAWQ's 2.5 bytes per column and
          group were 8 scalar 2-byte scale loads and an asm zero-point decode per tile)

Sections: cur (kernels/awq.py's awq_gemv, session 9), int (the integrated awq_gemv_repacked, = rp W 1, LOOP 0, RED 0),
flat (a load-only stream of the repacked bytes), rp (the experiment's kernel): program (column block, K split) of W
warps (one K tile per warp per loop step, U steps) over its contiguous chunk; per tile one f16x2 chain per 16 rows
(kernels/awq.py's _STEP_ASM), then the group scale in float32 (one asm: cvt + fma); LOOP 0: a runtime loop with the
next step's loads issued by hand before this step's arithmetic (the first step's weights before the PDL wait);
LOOP 1: tl.range(num_stages=STAGES) (cp.async into shared memory); LOOP 2: one step in registers at a time (other
warps hide the latency); MAXNREG caps registers. Split-K reduction RED 0: float32 partials + counter, the last
program sums them in a fixed order (deterministic, as kernels/awq.py); RED 1: float32 atomic adds into a zeroed
buffer + counter, the last program converts and re-zeroes (order of the adds not fixed); RED 2: RED 1 with each
warp's sums sent directly (no cross-warp reduction). --ncu: only launch one rp configuration (for ncu).

Each variant is checked against a float64 reference (x times the float64-dequantised weight; output NaN-poisoned
first), then timed per call inside a CUDA graph over rotating weight copies (> 400 MB), without and with PDL.
Prints a table last; every row also goes to DIR/rows.jsonl, the PDL variants' cubins to DIR/cubins.tar.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from awq_bench import GROUP, awq_bytes, graph_us, random_awq  # noqa: E402

from kernels import awq, pdl  # noqa: E402
from kernels.awq_reference import dequantize  # noqa: E402

BN8 = 16  # column groups (of 8) per program: 128 columns
MAX_SPLIT = 128  # the most K splits (the last program sums them unrolled, 8 at a time, RED 0)
KERNELS: dict = {}  # cfg -> the compiled kernel of its last launch (register counts, cubins)
RUN3 = False  # --rp-set run3
ROWS: list[dict] = []
OUT = "."


# -- repack: kernels/awq.py's awq_repack (the same layout) ---------------------------------------------------------


# The asm helpers (and their tl twins) are kernels/awq.py's, where this experiment's winner went: _x_pairs (bf16 row
# pairs -> (x/16, x/16) f16x2), _step_zc (kernels/awq.py's _STEP_ASM with the meta's zero-point words), _scale_acc
# (float32 accumulators + f16x2 accumulators times the f16x2 scale pairs).


# -- the repacked kernel --------------------------------------------------------------------------------------------


@triton.jit
def _rp_load_w(wbase, mbase, u, woff, moff, ok, W: tl.constexpr, BN8_: tl.constexpr):
    """Step u's weight-side loads: 16 slices [W, 8, BN8] (tile u W + w in warp w) and the 8 meta words [W, 1, BN8]."""
    SL: tl.constexpr = 8 * BN8_
    p = wbase + u * (W * 16 * SL) + woff
    q = (tl.load(p, mask=ok), tl.load(p + SL, mask=ok), tl.load(p + 2 * SL, mask=ok),
         tl.load(p + 3 * SL, mask=ok), tl.load(p + 4 * SL, mask=ok),
         tl.load(p + 5 * SL, mask=ok), tl.load(p + 6 * SL, mask=ok),
         tl.load(p + 7 * SL, mask=ok), tl.load(p + 8 * SL, mask=ok),
         tl.load(p + 9 * SL, mask=ok), tl.load(p + 10 * SL, mask=ok),
         tl.load(p + 11 * SL, mask=ok), tl.load(p + 12 * SL, mask=ok),
         tl.load(p + 13 * SL, mask=ok), tl.load(p + 14 * SL, mask=ok),
         tl.load(p + 15 * SL, mask=ok))  # fmt: skip
    m = mbase + u * (W * SL) + moff
    z = (tl.load(m, mask=ok), tl.load(m + BN8_, mask=ok), tl.load(m + 2 * BN8_, mask=ok),
         tl.load(m + 3 * BN8_, mask=ok))  # fmt: skip
    s = (tl.load(m + 4 * BN8_, mask=ok), tl.load(m + 5 * BN8_, mask=ok),
         tl.load(m + 6 * BN8_, mask=ok), tl.load(m + 7 * BN8_, mask=ok))  # fmt: skip
    return q, z, s


@triton.jit
def _rp_load_x(xbase, u, xoff, ok, W: tl.constexpr):
    """Step u's inputs: 8 bf16 pairs [W, 8, 1] (rows 128 t + 16 i + 2p, + 1 as one int32)."""
    px = xbase + u * (W * 64) + xoff
    return (tl.load(px, mask=ok), tl.load(px + 1, mask=ok), tl.load(px + 2, mask=ok),
            tl.load(px + 3, mask=ok), tl.load(px + 4, mask=ok), tl.load(px + 5, mask=ok),
            tl.load(px + 6, mask=ok), tl.load(px + 7, mask=ok))  # fmt: skip


@triton.jit
def _rp_tile(c, w, xp, ASM: tl.constexpr):
    q, z, s = w
    x0, x1 = awq._x_pairs(xp[0], True, ASM)
    x2, x3 = awq._x_pairs(xp[1], True, ASM)
    x4, x5 = awq._x_pairs(xp[2], True, ASM)
    x6, x7 = awq._x_pairs(xp[3], True, ASM)
    x8, x9 = awq._x_pairs(xp[4], True, ASM)
    x10, x11 = awq._x_pairs(xp[5], True, ASM)
    x12, x13 = awq._x_pairs(xp[6], True, ASM)
    x14, x15 = awq._x_pairs(xp[7], True, ASM)
    x = (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    z0, z1, z2, z3 = z
    a0, a1, a2, a3 = awq._step_zc(q[0], q[0], q[0], q[0], q[0], x[0], z0, z1, z2, z3, True, ASM)
    for r in tl.static_range(1, 16):
        a0, a1, a2, a3 = awq._step_zc(a0, a1, a2, a3, q[r], x[r], z0, z1, z2, z3, False, ASM)
    return awq._scale_acc(c, a0, a1, a2, a3, s, ASM)


@triton.jit
def _rp_kernel(
    x_ptr, wq_ptr, meta_ptr, out_ptr, part_ptr, acc_ptr, cnt_ptr, N, KT, split_k, U,
    BN8_: tl.constexpr, W: tl.constexpr, RED: tl.constexpr, LOOP: tl.constexpr, STAGES: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """x (bf16 pairs as int32) -> out [N]. Program (pid_n, pid_k): column block pid_n, tiles pid_k U W ... + U W."""
    TILE: tl.constexpr = 128 * BN8_
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t0 = pid_k * U * W
    wv = tl.arange(0, W)[:, None, None]
    iv = tl.arange(0, 8)[None, :, None]
    jv = tl.arange(0, BN8_)[None, None, :]
    woff = wv * TILE + iv * BN8_ + jv
    moff = wv * (8 * BN8_) + jv
    xoff = wv * 64 + iv * 8
    wbase = wq_ptr + (pid_n * KT + t0) * TILE
    mbase = meta_ptr + (pid_n * KT + t0) * (8 * BN8_)
    xbase = x_ptr + t0 * 64
    zero = tl.zeros([W, 8, BN8_], dtype=tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero)
    one = tl.full([1], 1, tl.int1)
    if LOOP == 0:
        w = _rp_load_w(wbase, mbase, 0, woff, moff, one, W, BN8_)
        pdl.gdc_sync(USE_PDL)
        xp = _rp_load_x(xbase, 0, xoff, one, W)
        for u in range(U):
            more = one & (u + 1 < U)
            w_next = _rp_load_w(wbase, mbase, u + 1, woff, moff, more, W, BN8_)
            x_next = _rp_load_x(xbase, u + 1, xoff, more, W)
            c = _rp_tile(c, w, xp, ASM)
            w = w_next
            xp = x_next
    elif LOOP == 1:
        pdl.gdc_sync(USE_PDL)
        for u in tl.range(0, U, num_stages=STAGES):
            w = _rp_load_w(wbase, mbase, u, woff, moff, None, W, BN8_)
            xp = _rp_load_x(xbase, u, xoff, None, W)
            c = _rp_tile(c, w, xp, ASM)
    else:  # one step in registers at a time: latency hidden by other warps (fewer registers, more warps per SM)
        w = _rp_load_w(wbase, mbase, 0, woff, moff, None, W, BN8_)
        pdl.gdc_sync(USE_PDL)
        xp = _rp_load_x(xbase, 0, xoff, None, W)
        c = _rp_tile(c, w, xp, ASM)
        for u in range(1, U):
            w = _rp_load_w(wbase, mbase, u, woff, moff, None, W, BN8_)
            xp = _rp_load_x(xbase, u, xoff, None, W)
            c = _rp_tile(c, w, xp, ASM)
    if RED == 2:  # each warp's row sums straight to float32 atomics: no cross-warp reduction (shared memory)
        # in the 3D layout of the accumulators, row group 0's lanes only: a reduced [W, BN8] tensor is replicated
        # over the row-group lanes, and Triton converted each one through shared memory (with barriers) for the
        # atomic
        cols = pid_n * BN8_ * 8 + jv * 8 + iv * 0 + wv * 0
        for col in tl.static_range(8):
            ysum = tl.sum(c[col], 1, keep_dims=True) + zero
            tl.atomic_add(acc_ptr + cols + col, ysum, mask=(iv == 0) & (wv >= 0), sem="relaxed", scope="gpu")
        tl.debug_barrier()
        cnt = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if cnt == split_k - 1:
            rn = pid_n * BN8_ * 8 + tl.arange(0, BN8_ * 8)
            y = tl.load(acc_ptr + rn, cache_modifier=".cg")
            tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty))
            tl.store(acc_ptr + rn, tl.zeros([BN8_ * 8], dtype=tl.float32))
            tl.store(cnt_ptr + pid_n, 0)
        return
    y = tl.join(
        tl.join(tl.join(tl.sum(tl.sum(c[0], 1), 0), tl.sum(tl.sum(c[4], 1), 0)),
                tl.join(tl.sum(tl.sum(c[2], 1), 0), tl.sum(tl.sum(c[6], 1), 0))),
        tl.join(tl.join(tl.sum(tl.sum(c[1], 1), 0), tl.sum(tl.sum(c[5], 1), 0)),
                tl.join(tl.sum(tl.sum(c[3], 1), 0), tl.sum(tl.sum(c[7], 1), 0))),
    )  # fmt: skip
    y = tl.reshape(y, [BN8_ * 8])
    rn = pid_n * BN8_ * 8 + tl.arange(0, BN8_ * 8)
    if SPLIT:
        if RED == 0:
            tl.store(part_ptr + pid_k * N + rn, y)
            tl.debug_barrier()
            cnt = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if cnt == split_k - 1:
                y = tl.zeros([BN8_ * 8], dtype=tl.float32)
                for ch in tl.static_range(SPLIT_PAD // 8):
                    rs = ch * 8 + tl.arange(0, 8)
                    p = tl.load(part_ptr + rs[:, None] * N + rn[None, :], mask=(rs < split_k)[:, None], other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                    y += tl.sum(p, 0)
                tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty))
                tl.store(cnt_ptr + pid_n, 0)
        else:
            tl.atomic_add(acc_ptr + rn, y, sem="relaxed", scope="gpu")
            tl.debug_barrier()
            cnt = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if cnt == split_k - 1:
                y = tl.load(acc_ptr + rn, cache_modifier=".cg")
                tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty))
                tl.store(acc_ptr + rn, tl.zeros([BN8_ * 8], dtype=tl.float32))
                tl.store(cnt_ptr + pid_n, 0)
    else:
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty))


_INTERPRETED = isinstance(_rp_kernel, InterpretedFunction)


class Repacked:
    def __init__(self, qweight, qzeros, scales):
        self.k, n8 = qweight.shape
        self.n = n8 * 8
        packed = awq.awq_repack(qweight, qzeros, scales, GROUP)
        self.wq, self.meta = packed.wq, packed.meta


def rp_gemv(x, pk: Repacked, cfg: dict, use_pdl: bool, counters, accbuf, out=None):
    k, n = pk.k, pk.n
    kt, nb = k // 128, n // 8 // BN8
    w, u = cfg["W"], cfg["U"]
    assert x.shape == (1, k) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert kt % (w * u) == 0
    split = kt // (w * u)
    assert split <= MAX_SPLIT and pk.wq.numel() < 2**31
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    assert split > 1 or cfg["RED"] != 2
    part = torch.empty(split, n, dtype=torch.float32, device=x.device) if split > 1 and cfg["RED"] == 0 else out
    kernel = _rp_kernel[(nb, split)](
        x.view(torch.int32), pk.wq, pk.meta, out, part, accbuf, counters, n, kt, split, u, BN8_=BN8, W=w,
        RED=cfg["RED"], LOOP=cfg["LOOP"], STAGES=cfg.get("STAGES", 1), SPLIT=split > 1,
        SPLIT_PAD=max(8, triton.next_power_of_2(split)), USE_PDL=use_pdl,
        ASM=not _INTERPRETED, num_warps=w, num_stages=1, **({"launch_pdl": True} if use_pdl else {}),
        **({"maxnreg": cfg["MAXNREG"]} if cfg.get("MAXNREG") else {}),
    )  # fmt: skip
    KERNELS[(str(cfg), use_pdl)] = kernel
    return out


# -- load-only ceiling over the same bytes --------------------------------------------------------------------------


@triton.jit
def _lo_flat(qw_ptr, out_ptr, V: tl.constexpr, U: tl.constexpr):
    """Program: U * V contiguous int32s (session 9's ceiling: ~3.2 TB/s in graphs)."""
    base = tl.program_id(0) * (U * V)
    acc = tl.zeros([V], dtype=tl.int32)
    for u in tl.static_range(U):
        acc ^= tl.load(qw_ptr + base + u * V + tl.arange(0, V))
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


# -- harness -------------------------------------------------------------------------------------------------------


def row(**kw) -> None:
    ROWS.append(kw)
    print("  ", json.dumps(kw), flush=True)
    with open(os.path.join(OUT, "rows.jsonl"), "a") as f:
        f.write(json.dumps(kw) + "\n")


def rp_bytes(k: int, n: int) -> int:
    return k * n // 2 + (k // GROUP) * n * 4


def graph_outputs(fn, inputs: list, replays: int = 2) -> list:
    """The outputs of fn over inputs captured in one CUDA graph (PDL edges between launches), after each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(*args) for args in inputs]
    res = []
    for _ in range(replays):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        res.append([o.clone() for o in outs])
    del graph
    return res


def rp_configs(k: int, n: int) -> list[dict]:
    """Run 2: one-warp programs (run 1: 2-8 warps were 1.5-4x slower at the same warps in flight), register caps
    (run 1: occupancy decided: W 1, U 2, 128 registers 11.5 us vs 15.2 uncapped on 4096x14336), loop styles,
    reductions, and larger K splits for 14336x4096 (more programs); two multi-warp rows as a diagnostic."""
    kt = k // 128
    us = (1, 2) if kt == 32 else (1, 2, 4)
    cfgs = [dict(W=1, U=u, RED=red, LOOP=2, MAXNREG=r) for u in us for r in (None, 96, 128) for red in (0, 1)
            if not (r == 96 and kt != 32)]
    u0 = (2, 4) if kt == 32 else (4, 7)
    cfgs += [dict(W=1, U=u, RED=0, LOOP=0, MAXNREG=r) for u in u0 for r in (None, 128)]
    cfgs += [dict(W=1, U=u0[0], RED=1, LOOP=0)]
    u1 = (2, 4) if kt == 32 else (4, 7, 14)
    cfgs += [dict(W=1, U=u, RED=0, LOOP=1, STAGES=st) for u in u1 for st in (2, 3, 4) if st <= u + 1]
    cfgs += [dict(W=w, U=1, RED=0, LOOP=2, MAXNREG=128) for w in (2, 4)]
    return [c for c in cfgs if kt % (c["W"] * c["U"]) == 0 and 4 <= kt // (c["W"] * c["U"]) <= MAX_SPLIT]


def rp_configs_run3(k: int, n: int) -> list[dict]:
    """Run 3: multi-warp programs whose warps send their partials straight to atomics (RED 2; run 2's ncu: 2-8
    warp programs spent their time in the cross-warp reduction through shared memory, 24 barriers), beside the
    best one-warp rows of run 2."""
    kt = k // 128
    u_best = 1 if kt == 32 and n == 4096 else 2
    cfgs = [dict(W=1, U=u_best, RED=1, LOOP=2, MAXNREG=128), dict(W=1, U=u_best, RED=2, LOOP=2, MAXNREG=128)]
    cfgs += [dict(W=w, U=u, RED=2, LOOP=2, MAXNREG=128) for w in (2, 4, 8) for u in (1, 2)]
    cfgs += [dict(W=w, U=1, RED=0, LOOP=2, MAXNREG=128) for w in (2, 4)]
    return [c for c in cfgs if kt % (c["W"] * c["U"]) == 0 and 4 <= kt // (c["W"] * c["U"]) <= MAX_SPLIT]


def run_shape(k: int, n: int, only: set) -> None:
    shape = f"{k}x{n}"
    n_sets = max(4, int(400e6 // awq_bytes(k, n)))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    sets = [random_awq(k, n) for _ in range(n_sets)]
    packed = [Repacked(*s) for s in sets]
    torch.cuda.synchronize()

    ws = [(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(max(4, int(400e6 // (2 * k * n))))]
    bf16 = graph_us(F.linear, ws)
    del ws
    row(shape=shape, variant="cublas_bf16", us=round(bf16, 2))

    def check(fn, name, cfg) -> float:
        errs = []
        for trial in range(2):
            i = trial % len(sets)
            xr = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) * (1 + 3 * trial)
            ref = xr.double() @ dequantize(*sets[i], GROUP).double()
            out = fn(xr, i)
            if torch.isnan(out).any():
                raise RuntimeError(f"{name} {cfg}: NaN in the output (unwritten elements?)")
            errs.append(((out.double() - ref).norm() / ref.norm()).item())
        return max(errs)

    def time_pair(name, make_fn, inputs, cfg, err, bytes_):
        us = graph_us(make_fn(False), inputs)
        us_pdl = graph_us(make_fn(True), inputs)
        row(shape=shape, variant=name, cfg=str(cfg), us=round(us, 2), us_pdl=round(us_pdl, 2),
            x=round(bf16 / us, 2), x_pdl=round(bf16 / us_pdl, 2), tbs_pdl=round(bytes_ / us_pdl / 1e6, 2),
            rel_err=f"{err:.1e}")  # fmt: skip

    if "cur" in only:

        def cur_fn(use_pdl):
            def f(x_, qw, qz, sc):
                pdl.enable(use_pdl)
                try:
                    return awq.awq_gemv(x_, qw, qz, sc, GROUP)
                finally:
                    pdl.enable(False)

            return f

        err = check(lambda xr, i: cur_fn(False)(xr, *sets[i]), "cur", {})
        time_pair("awq.py", cur_fn, [(x, *s) for s in sets], awq.gemv_config(1, n, k, GROUP), err, awq_bytes(k, n))

    if "flat" in only:
        out_i = torch.empty(k * n // 8, dtype=torch.int32, device="cuda")
        for v, u, w in ((1024, 8, 4), (2048, 8, 8), (1024, 4, 4)):
            total = packed[0].wq.numel()
            if total % (v * u):
                continue
            us = graph_us(lambda q, v=v, u=u, w=w: _lo_flat[(total // (v * u),)](q, out_i, V=v, U=u, num_warps=w),
                          [(p.wq,) for p in packed])  # fmt: skip
            row(shape=shape, variant="load_only_flat", cfg=f"V{v} U{u} w{w}", us=round(us, 2),
                tbs=round(k * n / 2 / us / 1e6, 2))  # fmt: skip

    if "rp" in only:
        counters = torch.zeros(n // 8, dtype=torch.int32, device="cuda")
        accbuf = torch.zeros(n, dtype=torch.float32, device="cuda")
        for cfg in (rp_configs_run3 if RUN3 else rp_configs)(k, n):
            name = "rp"
            try:
                t0 = time.time()

                def one(xr, i, cfg=cfg):
                    out = torch.full((1, n), float("nan"), dtype=xr.dtype, device="cuda")
                    return rp_gemv(xr, packed[i], cfg, False, counters, accbuf, out)

                err = check(one, name, cfg)

                def make(use_pdl, cfg=cfg):
                    return lambda x_, pk: rp_gemv(x_, pk, cfg, use_pdl, counters, accbuf)

                time_pair(name, make, [(x, p) for p in packed], cfg, err, rp_bytes(k, n))
                kern = KERNELS.get((str(cfg), True))
                regs = getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)
                ROWS[-1]["regs"] = regs[0]
                ROWS[-1]["spills"] = regs[1]
                assert not counters.any() and not accbuf.any(), "counters / buffer not back at 0"
                print(f"     ({time.time() - t0:.1f} s)", flush=True)
            except Exception as e:  # noqa: BLE001
                row(shape=shape, variant=name, cfg=str(cfg), error=f"{type(e).__name__}: {str(e)[:400]}")
                counters.zero_()
                accbuf.zero_()
        # graph + PDL, launches sharing counters: outputs equal eager ones (RED 0 is deterministic: bit for bit)
        cfg = dict(W=1, U=2 if k == n else 4, RED=0, LOOP=0)
        try:
            eager = [rp_gemv(x, p, cfg, False, counters, accbuf) for p in packed[:8]]
            reps = graph_outputs(lambda x_, pk: rp_gemv(x_, pk, cfg, True, counters, accbuf), [(x, p) for p in packed[:8]])
            same = all(torch.equal(a, b) for rep in reps for a, b in zip(rep, eager))
            row(shape=shape, variant="graph_pdl_check", cfg=str(cfg), same_as_eager=bool(same),
                counters_zero=not bool(counters.any()))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            row(shape=shape, variant="graph_pdl_check", error=f"{type(e).__name__}: {str(e)[:400]}")

    if "int" in only:  # kernels/awq.py's integrated path (awq_repack + awq_gemv_repacked), as AWQLinear runs it
        ipacked = [awq.awq_repack(*s, GROUP) for s in sets]
        icounters = awq.gemv_counters(n, "cuda")

        def int_fn(use_pdl):
            def f(x_, pk):
                pdl.enable(use_pdl)
                try:
                    return awq.awq_gemv_repacked(x_, pk, counters=icounters)
                finally:
                    pdl.enable(False)

            return f

        err = check(lambda xr, i: int_fn(False)(xr, ipacked[i]), "int", {})
        time_pair("awq_gemv_repacked", int_fn, [(x, p) for p in ipacked], {}, err, rp_bytes(k, n))
        eager = [int_fn(False)(x, p) for p in ipacked[:8]]
        reps = graph_outputs(int_fn(True), [(x, p) for p in ipacked[:8]])
        row(shape=shape, variant="int_graph_pdl_check", same_as_eager=all(torch.equal(a, b) for rep in reps
            for a, b in zip(rep, eager)), counters_zero=not bool(icounters.any()))  # fmt: skip
        time_pair("awq_gemv_repacked (again)", int_fn, [(x, p) for p in ipacked], {}, err, rp_bytes(k, n))
        del ipacked

    if "cur" in only:  # again: the spread between two timings of one kernel
        time_pair("awq.py (again)", cur_fn, [(x, *s) for s in sets], {}, err, awq_bytes(k, n))
    del sets, packed
    torch.cuda.empty_cache()


def summary() -> None:
    print("\n| shape | variant | cfg | us | us PDL | x bf16 (PDL) | rel err |")
    print("|---|---|---|---|---|---|---|")
    by_shape: dict = {}
    for r in ROWS:
        by_shape.setdefault(r.get("shape"), []).append(r)
    for shape, rs in by_shape.items():
        rp = sorted((r for r in rs if r.get("variant") == "rp" and "us_pdl" in r), key=lambda r: r["us_pdl"])
        best_of = {}
        for r in rp:  # the best of each loop style / reduction, then the next best overall
            best_of.setdefault(r["cfg"].split("'LOOP': ")[1][0] + r["cfg"].split("'RED': ")[1][0], r)
        picked = list(best_of.values()) + [r for r in rp[:4] if r not in best_of.values()]
        show = [r for r in rs if r.get("variant") != "rp"] + sorted(picked, key=lambda r: r["us_pdl"])
        for r in show:
            if "error" in r:
                print(f"| {shape} | {r['variant']} | {r.get('cfg', '')} | error: {r['error'][:80]} |")
                continue
            print(f"| {shape} | {r['variant']} | {r.get('cfg', '')} | {r.get('us', '-')} | {r.get('us_pdl', '-')} | "
                  f"{r.get('x', '-')} ({r.get('x_pdl', '-')}) | {r.get('rel_err', r.get('tbs', ''))} | {r.get('regs', '')} |")  # fmt: skip
    errs = [r for r in ROWS if "error" in r]
    print(f"\n{len(errs)} errors")


def main() -> None:
    global OUT
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--shapes", default="0,1,2")
    p.add_argument("--only", default="cur,flat,rp")
    p.add_argument("--ncu", default="", help="W,U,LOOP,MAXNREG: only launch that configuration (for ncu)")
    p.add_argument("--rp-set", default="run2", choices=("run2", "run3"))
    args = p.parse_args()
    global RUN3
    RUN3 = args.rp_set == "run3"
    if args.ncu:
        ncu_target(args.ncu)
        return
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    shapes = [(4096, 4096), (4096, 14336), (14336, 4096)]
    t0 = time.time()
    for i in args.shapes.split(","):
        k, n = shapes[int(i)]
        print(f"== {k}x{n} ({time.time() - t0:.0f} s)", flush=True)
        try:
            run_shape(k, n, set(args.only.split(",")))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    print(f"== done ({time.time() - t0:.0f} s)\n")
    summary()
    if KERNELS:  # the cubins (PDL variants) for cuobjdump on the development machine
        import io
        import tarfile

        with tarfile.open(os.path.join(OUT, "cubins.tar"), "w") as tar:
            for i, ((cfg, use_pdl), kern) in enumerate(KERNELS.items()):
                if use_pdl and "cubin" in getattr(kern, "asm", {}):
                    data = kern.asm["cubin"]
                    info = tarfile.TarInfo(f"k{i:02d}_" + "".join(ch for ch in cfg if ch.isalnum() or ch in ",") + ".cubin")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def ncu_target(spec: str) -> None:
    """Eager launches of one rp configuration on 4096x14336 (for ncu: the third launch is profiled)."""
    w, u, loop, maxnreg = (int(v) for v in spec.split(","))
    k, n = 4096, 14336
    pk = Repacked(*random_awq(k, n))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(n // 8, dtype=torch.int32, device="cuda")
    accbuf = torch.zeros(n, dtype=torch.float32, device="cuda")
    cfg = dict(W=w, U=u, RED=0, LOOP=loop, MAXNREG=maxnreg or None)
    for _ in range(4):
        rp_gemv(x, pk, cfg, False, counters, accbuf)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
