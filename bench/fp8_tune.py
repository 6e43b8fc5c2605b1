"""The launch-configuration sweep of `python bench/fp8_bench.py --tune` (its docstring says what is swept and
printed): the FP8 weight-only GEMV at M = 1 and fp8_matmul at a few rows, each candidate checked against the
pure-torch reference before it is timed, under a time budget. Also the shared helpers of fp8_bench.py (check,
bench_us)."""

from __future__ import annotations

import itertools
import time
from math import nan

import torch
import torch.nn.functional as F
import triton
import triton.testing

from aserve.kernels import fp8_gemv, gemv
from aserve.kernels.fp8 import quantize_per_token
from aserve.kernels.fp8_reference import dequantize, fp8_weight_only_linear
from aserve.kernels.fused import silu_and_mul

# GEMV: (BLOCK_N, BLOCK_K, num_warps), 16-64 weights per thread and row tile; each at every stage count.
GEMV_TILES = ((4, 1024, 4), (8, 1024, 4), (8, 512, 4), (16, 512, 4), (4, 2048, 8), (8, 1024, 8), (16, 1024, 8),
              (16, 512, 8), (32, 512, 8), (8, 2048, 8))  # fmt: skip
GEMV_STAGES = (2, 3)
# fp8_matmul by rows: the rows timed and, per BLOCK_M, (BLOCK_N values, BLOCK_K values, stages, SPLIT_K values)
MATMUL_ROWS = (2, 4, 8, 16, 32)
MATMUL_SPACE = {16: ((16, 32, 64), (128, 256, 512), (3, 4), (1, 2, 4)), 32: ((32, 64, 128), (128, 256), (3, 4), (1, 2))}
COMPILE_SHARE = 0.6  # of the budget, at most, for compiling the kernels before the timed sweep
WARMUP_MS, REP_MS = 5, 20  # short do_bench runs: the sweep has hundreds of candidates
DEVICE, DTYPE = "cuda", torch.bfloat16


def check(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 2e-2) -> None:
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    if err > tol:
        raise AssertionError(f"{what}: relative error {err:.3g} against the reference")


def bench_us(fn, warmup: int = 25, rep: int = 100) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def gemv_candidates(k: int) -> list[dict]:
    """The GEMV configurations swept for an [n, k] weight (those whose BLOCK_K divides k)."""
    return [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
            for (bn, bk, warps), stages in itertools.product(GEMV_TILES, GEMV_STAGES) if k % bk == 0]  # fmt: skip


def matmul_candidates(m: int) -> list[dict]:
    """fp8_matmul's configurations swept at m rows (BLOCK_M: 16 up to 16 rows, else 32)."""
    block_m = 16 if m <= 16 else 32
    block_ns, block_ks, stages, splits = MATMUL_SPACE[block_m]
    return [dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=s, num_warps=4, num_stages=st)
            for bn, bk, st, s in itertools.product(block_ns, block_ks, stages, splits)]  # fmt: skip


def key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def fmt(cfg: dict) -> str:
    return "dict(" + ", ".join(f"{k}={v!r}" for k, v in cfg.items()) + ")"


class Budget:
    """Slices of a time budget: slice i (of `weights`' sizes) ends at its share of the budget, counted from start;
    what a slice leaves unused goes to the later ones."""

    def __init__(self, seconds: float, weights: list[int]):
        self.start, total, ends, acc = time.monotonic(), max(1, sum(weights)), [], 0
        for w in weights:
            acc += w
            ends.append(seconds * acc / total)
        self.ends, self.skipped, self.failed = ends, 0, []

    def over(self, index: int) -> bool:
        return time.monotonic() - self.start > self.ends[index]


def sweep(fn_of, candidates: list[dict], want: torch.Tensor, what: str, budget: Budget, index: int) -> dict:
    """{config key: (us, config)} for the candidates that match the reference (split-K fp8_matmul ones also repeat
    bit for bit), timed until the slice's budget runs out; a candidate that fails a check is reported and left out."""
    timed = {}
    for cfg in candidates:
        if budget.over(index):
            budget.skipped += 1
            continue
        fn = fn_of(cfg)
        try:
            got = fn()
        except Exception as e:  # out of shared memory or registers: not a candidate on this GPU
            print(f"  {what} {fmt(cfg)}: skipped ({type(e).__name__})")
            continue
        try:
            check(got, want, f"{what} {fmt(cfg)}")
            if cfg.get("SPLIT_K", 1) > 1 and not torch.equal(fn(), got):
                raise AssertionError(f"{what} {fmt(cfg)}: a repeat differs (not reproducible)")
        except AssertionError as e:
            budget.failed.append(str(e))
            print(f"  FAILED: {e}")
            continue
        timed[key(cfg)] = (bench_us(fn, WARMUP_MS, REP_MS), cfg)
    return timed


def tune_gemv(name: str, n: int, k: int, w: torch.Tensor, scale: torch.Tensor, silu: bool, candidates: list[dict],
              budget: Budget, index: int) -> tuple | None:  # fmt: skip
    """The GEMV sweep of one shape -> (summary row, SCALED_GEMV_CONFIGS entry), None where nothing was timed."""
    x = torch.randn(1, 2 * k if silu else k, device=DEVICE, dtype=DTYPE)
    x_in = silu_and_mul(x) if silu else x
    want = fp8_weight_only_linear(x_in, w, scale)
    what = f"{name}{' silu_mul' if silu else ''} GEMV"
    current = gemv.scaled_gemv_config(n, k, silu_mul=silu)

    def fn_of(cfg):
        return lambda: fp8_gemv.fp8_gemv(x, w, scale, None, cfg, silu_mul=silu)

    timed = sweep(fn_of, [current] + [c for c in candidates if c != current], want, what, budget, index)
    if not timed:
        print(f"tune {what}: nothing timed")
        return None
    (best_us, best), now_us = min(timed.values(), key=lambda t: t[0]), timed.get(key(current), (nan,))[0]
    wb = dequantize(w, scale, DTYPE)
    bf16 = bench_us(lambda: F.linear(silu_and_mul(x) if silu else x, wb), WARMUP_MS, REP_MS)
    gbs = n * k / best_us / 1e3
    print(f"tune {what} {n}x{k}: {best_us:.1f} us ({gbs:.0f} GB/s) with {fmt(best)}; table {now_us:.1f} us; "
          f"bf16{' (+ silu_and_mul)' if silu else ''} {bf16:.1f} us; {len(timed)} timed")  # fmt: skip
    row = (f"{name}{' +silu' if silu else ''}", 1, bf16, now_us, best_us, gbs)
    return row, f"    # {row[0]}: {best_us:.1f} us, {gbs:.0f} GB/s\n    ({n}, {k}, {silu}): {fmt(best)},"


def tune_matmul(name: str, n: int, k: int, w: torch.Tensor, scale: torch.Tensor, m: int, budget: Budget,
                index: int) -> tuple[dict, tuple] | None:  # fmt: skip
    """fp8_matmul's sweep at one shape and M -> ({config key: us}, (bf16 us, _scaled_mm + quant us, the layer's
    us now)), None where nothing was timed."""
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    want = fp8_weight_only_linear(x, w, scale)
    wb, scale_b = dequantize(w, scale, DTYPE), scale.view(1, -1)

    def fn_of(cfg):
        return lambda: fp8_gemv.fp8_matmul(x, w, scale, config=cfg)

    def scaled_mm():
        q, s = quantize_per_token(x)
        return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=scale_b, out_dtype=DTYPE)

    current = fp8_gemv.matmul_config(m) or fp8_gemv.MATMUL_CONFIG
    current = {**current, "BLOCK_M": max(current["BLOCK_M"], 16 if m <= 16 else 32)}
    timed = sweep(fn_of, [current] + matmul_candidates(m), want, f"{name} M={m} fp8_matmul", budget, index)
    if not timed:
        print(f"tune {name} M={m} fp8_matmul: nothing timed")
        return None
    try:  # activations quantised too: a looser bound; reported, not fatal (it is the layer's kernel beyond MAX_ROWS)
        check(scaled_mm(), want, f"{name} M={m} _scaled_mm + quant", tol=8e-2)
    except AssertionError as e:
        budget.failed.append(str(e))
        print(f"  FAILED: {e}")
    scaled_us = bench_us(scaled_mm, WARMUP_MS, REP_MS)
    layer_us = timed.get(key(current), (nan,))[0] if m <= fp8_gemv.MAX_ROWS else scaled_us
    bf16 = bench_us(lambda: F.linear(x, wb), WARMUP_MS, REP_MS)
    best_us, best = min(timed.values(), key=lambda t: t[0])
    print(f"tune {name} M={m} fp8_matmul: {best_us:.1f} us ({n * k / best_us / 1e3:.0f} GB/s) with {fmt(best)}; "
          f"layer now {layer_us:.1f} us; bf16 {bf16:.1f} us; _scaled_mm + quant {scaled_us:.1f} us")  # fmt: skip
    return {cfg_key: us for cfg_key, (us, _) in timed.items()}, (bf16, scaled_us, layer_us)


def matmul_table(shapes: dict, per_m: dict, alt: dict, summary: list) -> list[str]:
    """MATMUL_CONFIGS' entries: per M bucket the configuration timed on every shape with the smallest total; None
    from the first bucket where the layer's torch._scaled_mm (+ quantisation) is faster in total. Adds the summary
    rows and notes where a shape's own best is > 10 % faster than the bucket's configuration."""
    entries, cut = [], False
    for m in MATMUL_ROWS:
        full = {ck: us for ck, us in per_m[m].items() if len(us) == len(shapes)}  # timed on every shape
        if not full:
            print(f"M={m}: no configuration timed on every shape (budget)")
            continue
        best_key = min(full, key=lambda ck: sum(full[ck].values()))
        total, scaled_total = sum(full[best_key].values()), sum(a[1] for a in alt[m].values())
        for name, (n, k) in shapes.items():
            bf16, _, layer_us = alt[m][name]
            us = full[best_key][name]
            summary.append((name, m, bf16, layer_us, us, n * k / us / 1e3))
            own_best = min(t[name] for t in per_m[m].values() if name in t)
            if us > 1.1 * own_best:
                print(f"  M={m} {name}: the bucket's configuration {us:.1f} us, this shape's best {own_best:.1f} us")
        cut = cut or scaled_total < total
        entry = "None" if cut else fmt(dict(best_key))
        entries.append(
            f"    # M <= {m}: {total:.1f} us summed over the shapes, _scaled_mm + quant {scaled_total:.1f} us"
        )
        entries.append(f"    ({m}, {entry}),")
    return entries


def compile_all(shapes: dict, weights: dict, gemv_cases: list, gemv_lists: list, seconds: float) -> int:
    """Runs each distinct kernel of the candidates once (Triton compiles it), for at most `seconds`, so the timed
    slices' budgets go to timing: kernels differ by their constexprs (tiles, warps, stages, split or not, SiLU·mul),
    not by shape or split count. Returns how many were compiled; failures are left to the sweep to report."""
    start, seen = time.monotonic(), set()
    runs = []
    for (name, silu), candidates in zip(gemv_cases, gemv_lists):
        k, (w, scale) = shapes[name][1], weights[name]
        x = torch.randn(1, 2 * k if silu else k, device=DEVICE, dtype=DTYPE)
        for cfg in candidates:
            kernel = ("gemv", silu, *(cfg[p] for p in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")))
            runs.append((kernel, lambda x=x, w=w, scale=scale, cfg=cfg, silu=silu: fp8_gemv.fp8_gemv(
                x, w, scale, None, cfg, silu_mul=silu)))  # fmt: skip
    name = next(iter(shapes))
    k, (w, scale) = shapes[name][1], weights[name]
    for m in MATMUL_ROWS:
        x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
        for cfg in matmul_candidates(m):
            kernel = ("matmul", *(cfg[p] for p in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")),
                      cfg["SPLIT_K"] > 1)  # fmt: skip
            runs.append((kernel, lambda x=x, cfg=cfg: fp8_gemv.fp8_matmul(x, w, scale, config=cfg)))
    for kernel, fn in runs:
        if kernel in seen or time.monotonic() - start > seconds:
            continue
        seen.add(kernel)
        try:
            fn()
        except Exception:  # out of resources or a failure: the sweep reports it
            pass
    print(f"compiled {len(seen)} kernels in {time.monotonic() - start:.0f} s")
    return len(seen)


def tune(shapes: dict, weights: dict, budget_s: float) -> None:
    """The sweep (bench/fp8_bench.py's docstring); weights: shape name -> (e4m3 weight, float32 scale), on the GPU."""
    gemv_cases = [(name, silu) for name in shapes for silu in ((False, True) if name == "down" else (False,))]
    gemv_lists = [gemv_candidates(shapes[name][1]) for name, _ in gemv_cases]
    gemv_sizes = [len(c) + 1 for c in gemv_lists]  # + 1: the table's configuration, swept first
    matmul_sizes = [len(matmul_candidates(m)) + 1 for _ in shapes for m in MATMUL_ROWS]
    start = time.monotonic()
    compile_all(shapes, weights, gemv_cases, gemv_lists, COMPILE_SHARE * budget_s)
    budget = Budget(budget_s - (time.monotonic() - start), gemv_sizes + matmul_sizes)
    summary, gemv_entries = [], []
    for index, ((name, silu), candidates) in enumerate(zip(gemv_cases, gemv_lists)):
        found = tune_gemv(name, *shapes[name], *weights[name], silu, candidates, budget, index)
        if found:
            summary.append(found[0])
            gemv_entries.append(found[1])
    per_m = {m: {} for m in MATMUL_ROWS}  # m -> config key -> {shape: us}
    alt = {m: {} for m in MATMUL_ROWS}  # m -> shape -> (bf16 us, _scaled_mm + quant us, the layer's us now)
    index = len(gemv_cases)
    for name, (n, k) in shapes.items():
        for m in MATMUL_ROWS:
            found = tune_matmul(name, n, k, *weights[name], m, budget, index)
            index += 1
            if found:
                for cfg_key, us in found[0].items():
                    per_m[m].setdefault(cfg_key, {})[name] = us
                alt[m][name] = found[1]
    matmul_entries = matmul_table(shapes, per_m, alt, summary)
    print("\n| shape | M | bf16 us | table / layer now us | best us | best GB/s | best / bf16 |")
    print("|---|---|---|---|---|---|---|")
    for name, m, bf16, now_us, best_us, gbs in summary:
        print(f"| {name} | {m} | {bf16:.1f} | {now_us:.1f} | {best_us:.1f} | {gbs:.0f} | {best_us / bf16:.2f} |")
    for failure in budget.failed:
        print(f"FAILED: {failure}")
    took = time.monotonic() - start
    print(f"\n{len(budget.failed)} candidates failed a check, {budget.skipped} skipped (budget {budget_s:.0f} s); "
          f"the sweep took {took:.0f} s\n")  # fmt: skip
    print("# aserve/kernels/gemv.py\nSCALED_GEMV_CONFIGS: dict[tuple[int, int, bool], dict] = {")
    print("\n".join(gemv_entries) + "\n}\n\n# aserve/kernels/fp8_gemv.py\nMATMUL_CONFIGS = (")
    print("\n".join(matmul_entries) + "\n    (None, None),\n)")
