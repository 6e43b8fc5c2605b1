"""GPU benchmark of AWQ int4 (aserve/kernels/awq/) against bf16 cuBLAS, and of an AWQ Llama-3-8B-shaped model's
batch-1 decode against the bf16 one, in one command:

    PYTHONPATH=. python bench/awq_bench.py --out DIR [--sections correctness,tune,kernels,decode]

correctness  the kernels against the pure-torch reference at full shapes (bf16 activations, group 128); the M = 1
             f16x2 GEMV inside a CUDA graph with programmatic dependent launch, back-to-back launches sharing
             one set of split-K counters, against eager launches
tune         launch-config sweeps: the M = 1 f16x2 GEMV inside CUDA graphs (summed over the three shapes; the best
             becomes the config the later sections use, print it and copy it into aserve/kernels/awq/tuning.py), the
             dequantise kernel
kernels      int4 vs bf16 cuBLAS (F.linear, as aserve's bf16 layers) for M = 1, 4, 16, 64, 256, 2048 on
             4096x4096, 4096x14336, 14336x4096 (K x N): time, speed-up, and the path awq_linear picks; plus each
             path alone where it applies (gemv M <= 16; dequantise + cuBLAS M >= 16). Targets: GEMV at M = 1 >= 3x
             (ideal ~3.9x: 4.25 vs 16 bits per weight), M = 2048 >= 0.8x
tune_graph   the M = 1 sweep of tune alone
small_m      M = 1-16 in CUDA graphs with PDL: bf16 vs the f16x2 kernel (one program per row) vs tl.dot, both
             over the repacked copy; sets the row count up to which the f16x2 kernel is used
tune_repacked  launch-config sweeps of the tl.dot GEMV (M = 4, 16) and the dequantise kernel over awq_repack's
             layout (the layout an AWQ layer keeps on a GPU: the kernels section times the engine's path on it)
m1_graph     M = 1 again, inside CUDA graphs over rotating weight copies with programmatic dependent launch (how
             decode runs: no launch gaps), over the repacked copy (the engine's path) and the AutoAWQ tensors
silu         SiLU·mul applied by the gate/up projection's kernel vs that GEMV + silu_and_mul (graphs, M = 1, 2,
             4), and AWQ decode with and without it
decode       batch-1 decode, 128 prompt + 256 generated tokens, Llama-3-8B shape with random weights
             (load_format=dummy): bf16 vs AWQ int4 g128 (random packed weights), without and with the int4 lm_head
             (--quantize-lm-head); target >= 3x bf16 speed

Prints a table last; writes results.json under --out. The load-only ceilings of the weights' stream are
bench/awq_load_ceilings.py.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_bench import (  # noqa: E402
    RESULTS,
    batch1_decode_ms,
    bench_ms,
    dummy_model_dir,
    record,
    run_section,
    write_results,
)

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K = in, N = out)
ROWS = [1, 4, 16, 64, 256, 2048]
GROUP = 128


def random_awq(k: int, n: int, group: int = GROUP):
    qweight = torch.randint(-(2**31), 2**31, (k, n // 8), dtype=torch.int32, device="cuda")
    qzeros = torch.randint(-(2**31), 2**31, (k // group, n // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(k // group, n, device="cuda") * 0.004 + 1e-4).half()
    return qweight, qzeros, scales


def awq_bytes(k: int, n: int, group: int = GROUP) -> int:
    return k * n // 2 + (k // group) * n * (2 + 0.5)


def correctness() -> None:
    from aserve.kernels.awq import awq_dequantize, awq_dequantize_repacked, awq_gemv, awq_linear, awq_repack
    from aserve.kernels.awq_reference import awq_matmul, dequantize

    for k, n in SHAPES:
        qweight, qzeros, scales = random_awq(k, n)
        exact = torch.equal(awq_dequantize(qweight, qzeros, scales, GROUP, torch.float32),
                            dequantize(qweight, qzeros, scales, GROUP))  # fmt: skip
        errs = []
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = awq_matmul(x.float(), qweight, qzeros, scales, GROUP)
            fns = [awq_linear] + ([awq_gemv] if m <= 16 else [])
            for fn in fns:
                out = fn(x, qweight, qzeros, scales, GROUP).float()
                errs.append(((out - ref).norm() / ref.norm()).item())
        record(f"correct_{k}x{n}", f"max rel err {max(errs):.2e}", "", f"(dequantise exact: {exact}; bf16 ~4e-3)")
        packed = awq_repack(qweight, qzeros, scales, GROUP)
        exact = torch.equal(awq_dequantize_repacked(packed, torch.float32), dequantize(qweight, qzeros, scales, GROUP))
        errs = []
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = awq_matmul(x.float(), qweight, qzeros, scales, GROUP)
            out = awq_linear(x, None, None, None, GROUP, packed=packed).float()
            errs.append(((out - ref).norm() / ref.norm()).item())
        record(f"correct_repacked_{k}x{n}", f"max rel err {max(errs):.2e}", "",
               f"(repacked copy alone, every M; its dequantise exact: {exact})")  # fmt: skip
    m1_graph_pdl_check()


def m1_graph_pdl_check() -> None:
    """The M = 1 GEMV as decode runs it: 24 back-to-back launches on different weights of one shape (so one shared
    set of split-K counters) in a CUDA graph, with programmatic dependent launch, replayed 3 times; every output must
    equal an eager launch's bit for bit (the reduction order is fixed) and the counters must end at zero."""
    from aserve.kernels import awq, pdl
    from aserve.kernels.awq import split_k

    k, n = 4096, 14336
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = [random_awq(k, n) for _ in range(24)]
    eager = [awq.awq_gemv(x, *w, GROUP) for w in weights]
    pdl.enable(True)
    try:
        awq.awq_gemv(x, *weights[0], GROUP)  # compiles the PDL variant outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [awq.awq_gemv(x, *w, GROUP) for w in weights]
        same = True
        for _ in range(3):
            for o in outs:
                o.zero_()
            graph.replay()
            torch.cuda.synchronize()
            same &= all(torch.equal(o, e) for o, e in zip(outs, eager))
    finally:
        pdl.enable(False)
    counters = split_k._shared_counters(n, x.device)
    record("correct_m1_graph_pdl", bool(same and not counters.any()), "",
           "(24 launches sharing counters, graph + PDL, 3 replays == eager; counters back at 0)")  # fmt: skip


def tune_gemv1() -> None:
    """M = 1 f16x2 GEMV configurations timed inside CUDA graphs over rotating weight copies (graph_us; do_bench's
    per-call L2 flush and event overhead put a ~10 us floor under every config, which hides the differences),
    summed over the three shapes. The best becomes tuning.GEMV1_CONFIG for the later sections."""
    from aserve.kernels import awq
    from aserve.kernels.awq import tuning

    configs = [
        dict(BLOCK_N=bn, BLOCK_K=bk, R=r, TILES=t, num_warps=w, num_stages=1)
        for bn, w in ((64, 1), (128, 2), (256, 4))
        for bk in (64, 128)
        for r in (8, 16)
        for t in (1, 2, 4)
    ]
    totals: dict[int, list[float]] = {}
    for k, n in SHAPES:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        qs = [(x, *random_awq(k, n)) for _ in range(max(4, int(400e6 // awq_bytes(k, n))))]
        for i, cfg in enumerate(configs):
            try:
                us = graph_us(lambda x_, qw, qz, sc, cfg=cfg: awq.awq_gemv(x_, qw, qz, sc, GROUP, config=cfg), qs)
            except Exception as e:  # noqa: BLE001  (out of resources)
                print(f"   config failed {cfg} {type(e).__name__}", flush=True)
                continue
            totals.setdefault(i, []).append(us)
        del qs
    ranked = sorted((i for i in totals if len(totals[i]) == len(SHAPES)), key=lambda i: sum(totals[i]))
    for i in ranked[:10]:
        print(f"   gemv M=1 {configs[i]}: {' / '.join(f'{t:.1f}' for t in totals[i])} us (graph)", flush=True)
    tuning.GEMV1_CONFIG = configs[ranked[0]]
    record("tune_gemv_m1", " / ".join(f"{t:.1f}" for t in totals[ranked[0]]), "us (graph)", str(configs[ranked[0]]))


def tune() -> None:
    from aserve.kernels import awq
    from aserve.kernels.awq import tuning

    tune_gemv1()
    k, n = 4096, 14336
    qweight, qzeros, scales = random_awq(k, n)
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
               for bn in (64, 128, 256) for bk in (32, 64, 128) for w in (4, 8)]  # fmt: skip
    ms, best = _sweep("dequant", configs, lambda cfg: bench_ms(
        lambda: awq.awq_dequantize(qweight, qzeros, scales, GROUP, torch.bfloat16, cfg), 5, 25))  # fmt: skip
    tuning.DEQUANT_CONFIG = best
    moved = awq_bytes(k, n) + 2 * k * n
    record("tune_dequant", f"{ms * 1e3:.1f}", "us", f"{best} ({moved / ms / 1e9:.2f} TB/s read + written)")


def _sweep(name: str, configs: list[dict], ms_of) -> tuple[float, dict]:
    """Times every config (ms_of(config)); prints the five fastest -> (best ms, best config)."""
    timings = []
    for cfg in configs:
        try:
            timings.append((ms_of(cfg), cfg))
        except Exception as e:  # noqa: BLE001  (out of resources)
            print("   config failed", cfg, type(e).__name__, flush=True)
    timings.sort(key=lambda t: t[0])
    for ms, cfg in timings[:5]:
        print(f"   {name} {cfg}: {ms * 1e3:.1f} us", flush=True)
    return timings[0]


def tune_repacked() -> None:
    """Launch-config sweeps of the kernels over awq_repack's layout: the tl.dot GEMV (M = 4 and 16, summed over the
    three shapes) and the dequantise kernel (4096x14336). The best become the configs the later sections use."""
    from aserve.kernels import awq
    from aserve.kernels.awq import tuning

    sets = [awq.awq_repack(*random_awq(k, n), GROUP) for k, n in SHAPES]

    def dot_ms(cfg: dict) -> float:
        total = 0.0
        for packed in sets:
            for m in (4, 16):
                x = torch.randn(m, packed.in_features, device="cuda", dtype=torch.bfloat16)
                total += bench_ms(lambda: awq.awq_gemv_repacked_dot(x, packed, None, cfg), 5, 25)
        return total

    configs = [dict(BP=bp, num_warps=w, num_stages=st, SWAP=swap)  # SWAP: out^T = W^T x^T (wgmma on Hopper)
               for swap, bp, w, st in itertools.product((False, True), (32, 64, 128), (4, 8), (1, 2, 3))]  # fmt: skip
    best_ms, tuning.REPACKED_DOT_CONFIG = _sweep("dot (M 4 + 16 summed)", configs, dot_ms)
    record("tune_repacked_dot", f"{best_ms * 1e3:.1f}", "us", f"{tuning.REPACKED_DOT_CONFIG} (M 4 + 16, three shapes)")
    packed = sets[1]
    k, n = SHAPES[1]
    configs = [dict(BP=bp, num_warps=w) for bp, w in itertools.product((16, 32, 64, 128), (4, 8))]
    best_ms, tuning.REPACKED_DEQUANT_CONFIG = _sweep(
        "dequant", configs,
        lambda cfg: bench_ms(lambda: awq.awq_dequantize_repacked(packed, torch.bfloat16, cfg), 5, 25))  # fmt: skip
    moved = awq_bytes(k, n) + 2 * k * n
    record("tune_repacked_dequant", f"{best_ms * 1e3:.1f}", "us",
           f"{tuning.REPACKED_DEQUANT_CONFIG} ({moved / best_ms / 1e9:.2f} TB/s read + written)")  # fmt: skip


def kernels() -> None:
    from aserve.kernels import awq
    from aserve.kernels.awq import tuning

    print(
        "\n| K x N | M | bf16 cuBLAS us | int4 us (path) | speed-up | AutoAWQ-tensor kernels us | gemv us | "
        "dequant+mm us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        qweight, qzeros, scales = random_awq(k, n)
        packed = awq.awq_repack(qweight, qzeros, scales, GROUP)  # what an AWQ layer runs on (and all it keeps)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = bench_ms(lambda: F.linear(x, w))
            int4 = bench_ms(lambda: awq.awq_linear(x, None, None, None, GROUP, packed=packed))
            autoawq = bench_ms(lambda: awq.awq_linear(x, qweight, qzeros, scales, GROUP))
            path = "gemv" if m <= tuning.GEMV_MAX_M else "dequant+mm"
            gemv = bench_ms(lambda: awq.awq_gemv(x, qweight, qzeros, scales, GROUP)) if m <= 16 else None
            deq = bench_ms(lambda: x @ awq.awq_dequantize(qweight, qzeros, scales, GROUP, x.dtype)) if m >= 16 else None
            fmt = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
            print(f"| {k}x{n} | {m} | {bf16 * 1e3:.1f} | {int4 * 1e3:.1f} ({path}) | {bf16 / int4:.2f}x | "
                  f"{autoawq * 1e3:.1f} | {fmt(gemv)} | {fmt(deq)} |", flush=True)  # fmt: skip
            RESULTS[f"kernel_{k}x{n}_m{m}"] = {"value": round(bf16 / int4, 3), "unit": "x", "note": (
                f"bf16 {bf16 * 1e3:.1f} us, int4 repacked {int4 * 1e3:.1f} us ({path}), AutoAWQ-tensor kernels "
                f"{autoawq * 1e3:.1f} us; gemv {fmt(gemv)}, dequant+mm {fmt(deq)}")}  # fmt: skip
            if m == 1:
                record(f"gemv_m1_{k}x{n}_bandwidth", round(awq_bytes(k, n) / int4 / 1e9, 2), "TB/s",
                       f"(speed-up {bf16 / int4:.2f}x; target >= 3x)")  # fmt: skip


def small_m() -> None:
    """M = 1-16 inside CUDA graphs with PDL (decode batches, speculative verification): bf16 cuBLAS vs the kernels
    over the repacked copy: the f16x2 one with one or two rows per program, and the tl.dot one. Sets
    tuning.REPACKED_GEMV1_ROWS to the faster f16x2 variant (summed over M 2-16 and the shapes) and
    tuning.REPACKED_GEMV1_MAX_M to the largest M up to which it beats tl.dot, summed over the shapes."""
    from aserve.kernels import awq, pdl
    from aserve.kernels.awq import tuning

    rows = (1, 2, 3, 4, 6, 8, 16)
    sums = {m: [0.0, 0.0, 0.0] for m in rows}  # f16x2 one row, f16x2 two rows, tl.dot
    print("\n| K x N | M | bf16 us | f16x2, 1 row / program us | f16x2, 2 rows / program us | tl.dot us | best |")
    print("|---|---|---|---|---|---|---|")
    pdl.enable(True)
    try:
        for k, n in SHAPES:
            copies = max(4, int(400e6 // (2 * k * n)))
            bf16_w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            packs = [awq.awq_repack(*random_awq(k, n), GROUP) for _ in range(max(4, int(400e6 // awq_bytes(k, n))))]
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bf16 = graph_us(F.linear, [(x, w) for w in bf16_w])
                one = graph_us(lambda x_, p: awq.awq_gemv_repacked(x_, p, rows=1), [(x, p) for p in packs])
                two = graph_us(lambda x_, p: awq.awq_gemv_repacked(x_, p, rows=2), [(x, p) for p in packs])
                dot = graph_us(awq.awq_gemv_repacked_dot, [(x, p) for p in packs])
                for i, v in enumerate((one, two, dot)):
                    sums[m][i] += v
                best = min(one, two, dot)
                print(f"| {k}x{n} | {m} | {bf16:.1f} | {one:.1f} | {two:.1f} | {dot:.1f} | {bf16 / best:.2f}x |",
                      flush=True)  # fmt: skip
                RESULTS[f"small_m_{k}x{n}_m{m}"] = {"value": round(bf16 / best, 3), "unit": "x", "note": (
                    f"graph + PDL: bf16 {bf16:.1f} us, f16x2 1 / 2 rows per program {one:.1f} / {two:.1f} us, "
                    f"tl.dot {dot:.1f} us")}  # fmt: skip
            del bf16_w, packs
    finally:
        pdl.enable(False)
    two_rows = sum(sums[m][1] for m in rows if m > 1) < sum(sums[m][0] for m in rows if m > 1)
    tuning.REPACKED_GEMV1_ROWS = 2 if two_rows else 1
    f16x2 = 1 if two_rows else 0
    tuning.REPACKED_GEMV1_MAX_M = max(m for m in rows if all(sums[r][f16x2] <= sums[r][2] for r in rows if r <= m))
    record(
        "small_m_f16x2",
        f"{tuning.REPACKED_GEMV1_ROWS} rows / program up to M = {tuning.REPACKED_GEMV1_MAX_M}",
        "",
        "(the faster f16x2 variant over M 2-16, and the largest M up to which it beats tl.dot)",
    )


def graph_us(fn, inputs: list) -> float:
    """Time per call of fn(*inputs[i]) for rotating inputs, all calls in one CUDA graph (as decode runs): no launch
    gaps, and the inputs together exceed the L2 cache several times, so weights come from memory. Median of 5."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in inputs[:2]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(inputs))
    del graph
    return sorted(times)[2]


def m1_graph() -> None:
    """M = 1 inside CUDA graphs with programmatic dependent launch (as decode runs on Hopper): bf16 cuBLAS vs the
    int4 f16x2 GEMV over the repacked copy (what an AWQ layer runs) and over the AutoAWQ tensors."""
    from aserve.kernels import awq, pdl

    print("\n| K x N | bf16 us | int4 repacked us | speed-up | int4 TB/s | AutoAWQ-tensor kernel us | SPLIT_K |")
    print("|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        copies_bf16 = max(4, int(400e6 // (2 * k * n)))
        copies_int4 = max(4, int(400e6 // awq_bytes(k, n)))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = [(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(copies_bf16)]
        bf16 = graph_us(F.linear, ws)
        del ws
        pdl.enable(True)
        try:
            qs = [(x, *random_awq(k, n), GROUP) for _ in range(copies_int4)]
            autoawq = graph_us(awq.awq_gemv, qs)
            ps = [(x, awq.awq_repack(*q[1:4], GROUP)) for q in qs]
            del qs
            int4 = graph_us(awq.awq_gemv_repacked, ps)
            del ps
        finally:
            pdl.enable(False)
        split_k = awq.gemv_config(1, n, k, GROUP)["SPLIT_K"]
        print(f"| {k}x{n} | {bf16:.1f} | {int4:.1f} | {bf16 / int4:.2f}x | {awq_bytes(k, n) / int4 / 1e6:.2f} | "
              f"{autoawq:.1f} | {split_k} |", flush=True)  # fmt: skip
        record(f"graph_m1_{k}x{n}", round(bf16 / int4, 2), "x",
               f"bf16 {bf16:.1f} us, int4 repacked {int4:.1f} us ({awq_bytes(k, n) / int4 / 1e6:.2f} TB/s), "
               f"AutoAWQ-tensor kernel {autoawq:.1f} us; PDL; target >= 3x")  # fmt: skip


def silu(root: str) -> None:
    """SiLU·mul applied by the gate/up projection's M <= 6 kernel (silu_mul_out: the last program of each gate / up
    column-block pair) against that GEMV then aserve/kernels/fused.py's silu_and_mul, in CUDA graphs with PDL at
    4096x28672, M = 1, 2, 4; then AWQ decode with it (the default) and without (AWQLinearMethod.fuses_silu_mul_out
    patched to False, so the MLP runs the GEMV, then silu_and_mul)."""
    from aserve.kernels import awq, pdl
    from aserve.kernels.fused import silu_and_mul
    from aserve.layers.quantization.awq import AWQLinearMethod

    k, n = 4096, 28672
    print("\n| M | GEMV + silu_and_mul us | fused us | change |")
    print("|---|---|---|---|")
    for m in (1, 2, 4):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copies = max(4, int(400e6 // awq_bytes(k, n)))
        ps = [(x, awq.awq_repack(*random_awq(k, n)[:3], GROUP)) for _ in range(copies)]
        pdl.enable(True)
        try:
            unfused = graph_us(lambda x, p: silu_and_mul(awq.awq_gemv_repacked(x, p)), ps)
            fused = graph_us(lambda x, p: awq.awq_gemv_repacked(x, p, silu_mul_out=True), ps)
        finally:
            pdl.enable(False)
        del ps
        print(f"| {m} | {unfused:.1f} | {fused:.1f} | {100 * (fused / unfused - 1):+.1f} % |", flush=True)
        record(f"silu_gate_up_m{m}", round(fused, 1), "us", f"unfused (GEMV + silu_and_mul) {unfused:.1f} us")
    awq_dir = awq_model_dir(root)
    fused = decode_ms_per_token(awq_dir)
    fuses = AWQLinearMethod.fuses_silu_mul_out
    AWQLinearMethod.fuses_silu_mul_out = lambda self, layer, x: False
    try:
        unfused = decode_ms_per_token(awq_dir)
    finally:
        AWQLinearMethod.fuses_silu_mul_out = fuses
    record("silu_decode_awq", round(fused, 3), "ms/token", f"without the fusion {unfused:.3f} ms/token")


def decode_profile(llm, name: str, steps: int = 64) -> None:
    """GPU time per decode step by kernel (torch.profiler over a batch-1 request of `steps` tokens): where the step
    goes besides the quantised linears. (With programmatic dependent launch a kernel's time includes its wait for the
    one before: ASERVE_PDL=0 for each kernel's own.)"""
    from torch.profiler import ProfilerActivity, profile

    from aserve import SamplingParams

    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    rows = [(e.device_time_total, e.count, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\n{name}: GPU time per decode step by kernel ({steps} steps; us per step, calls per step)")
    for t, count, key in rows[:20]:
        print(f"  {t / steps:9.1f} us  {count / steps:6.1f}  {key[:110]}")
    record(f"decode_profile_{name}", round(total / steps, 1), "us GPU per step", f"(top: {rows[0][2][:60]})")


def decode_ms_per_token(model_dir: str, profile: bool = False, quantize_lm_head: bool = False) -> float:
    from aserve import LLM

    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
              quantize_lm_head=quantize_lm_head)  # fmt: skip
    ms = batch1_decode_ms(llm)
    model = llm.engine.core.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes += sum(t.numel() * t.element_size() for m in model.modules()
                        for t in (getattr(m, "repacked", None) or ())[:2])  # AWQ: the repacked copy  # fmt: skip
    name = os.path.basename(os.path.dirname(model_dir)) + ("_head" if quantize_lm_head else "")
    if profile:
        decode_profile(llm, name)
    record(f"decode_weights_{name}", round(weight_bytes / 1e9, 2), "GB")
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def awq_model_dir(root: str) -> str:
    """A Llama-3-8B-shaped AWQ g128 model directory (load_format=dummy gives it random packed weights)."""
    awq_dir = dummy_model_dir(os.path.join(root, "awq"))
    with open(os.path.join(awq_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    with open(os.path.join(awq_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return awq_dir


def decode(root: str) -> None:
    bf16_dir = dummy_model_dir(os.path.join(root, "bf16"))
    awq_dir = awq_model_dir(root)
    bf16 = decode_ms_per_token(bf16_dir, profile=True)
    record("decode_b1_bf16", round(bf16, 3), "ms/token")
    int4 = decode_ms_per_token(awq_dir, profile=True)
    record("decode_b1_awq_int4", round(int4, 3), "ms/token", f"({bf16 / int4:.2f}x bf16; target >= 3x)")
    head = decode_ms_per_token(awq_dir, profile=True, quantize_lm_head=True)
    record("decode_b1_awq_int4_int4_head", round(head, 3), "ms/token", f"({bf16 / head:.2f}x bf16; --quantize-lm-head)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="correctness,tune,kernels,m1_graph,decode")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    root = tempfile.mkdtemp()
    run = {
        "correctness": correctness,
        "tune": tune,
        "tune_graph": tune_gemv1,
        "tune_repacked": tune_repacked,
        "small_m": small_m,
        "kernels": kernels,
        "m1_graph": m1_graph,
        "decode": lambda: decode(root),
        "silu": lambda: silu(root),
    }
    for name in args.sections.split(","):
        run_section(name, run[name])
    write_results(args.out)


if __name__ == "__main__":
    main()
