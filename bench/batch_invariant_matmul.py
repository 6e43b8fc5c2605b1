"""Deterministic mode's GPU matmul (aserve/kernels/batch_invariant_matmul.py): every candidate configuration checked
for bitwise row invariance and timed against cuBLAS on Llama-3-8B's linear shapes (bf16; --shapes also Qwen3-30B-A3B's
attention and router linears, moe_qkv,moe_o,moe_router, and the two models' lm_heads, head,moe_head), in one command
(under 4 minutes on an H200):

    PYTHONPATH=. python bench/batch_invariant_matmul.py [--candidates old,split128] [--shapes ...] [--json FILE]

invariance  per shape and candidate: 512 random rows, each row's result alone (M = 1) kept; then --trials batches
            of M = 1, 2, 3, 4, 8, 16, 17, 32, 64, 128, 256, 512 of those rows in random order, run in the launch mode
            the kernel picks for M and in the other one: every row's bits must equal its M = 1 result. Also the
            largest error against F.linear in float32, relative to the largest output.
timing      GPU time of one call at M = 1, 8, 64, 256, 2048 (--time-rows) inside a CUDA graph that cycles through
            weight copies of >= 256 MB (so L2 holds none), programmatic dependent launch on as the engine runs on
            Hopper (--no-pdl: off); the candidates' and F.linear's (cuBLAS). For DEFAULT also the other launch mode,
            to place the switch between them (ACROSS_MAX_ROWS, PROGRAMS).

Prints per shape and M the microseconds and the ratio to cuBLAS, the shapes' total per M (with the default four,
one decoder layer's linears), invariance per candidate, and the candidate to make DEFAULT: the one with the smallest
geometric mean over M of the totals' ratio to cuBLAS among those that passed (a candidate with ROW_TILES only as far
as this GPU showed its BLOCK_M changes to give the same bits). Exit status 1 if any candidate's rows differed or a
result was off the reference, else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from decode_kernels import graph_us  # (bench/ is this script's directory)

from aserve.kernels import batch_invariant_matmul as bim
from aserve.kernels import pdl

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "moe_qkv": (5120, 2048), "moe_o": (2048, 4096), "moe_router": (128, 2048),
          "head": (128256, 4096), "moe_head": (151936, 2048)}  # fmt: skip
LLAMA = "qkv,o,gate_up,down"  # Llama-3-8B's linears; moe_*: Qwen3-30B-A3B's (its experts are aserve/kernels/moe.py's)
# head, moe_head: Llama-3-8B's and Qwen3-30B-A3B's lm_head (run outside the decode CUDA graph, on the sampling rows)
CHECK_ROWS = (1, 2, 3, 4, 8, 16, 17, 32, 64, 128, 256, 512)
POOL = 512
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[rows] True where a row of a and of b differ in any bit."""
    return (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).any(dim=1)


def check(cfg: dict, w: torch.Tensor, pool: torch.Tensor, trials: int, gen: torch.Generator) -> tuple[list, float]:
    """(failures as text, relative error against F.linear) of one candidate on one weight."""
    alone = torch.cat([bim.matmul(pool[i : i + 1], w, None, cfg) for i in range(POOL)])
    ref = F.linear(pool.float(), w.float())
    err = ((alone.float() - ref).abs().max() / ref.abs().max()).item()
    failures = []
    n = w.shape[0]
    for m in CHECK_ROWS:
        auto = bim.use_across(cfg, m, n, bim.row_tile(cfg, m, n))
        modes = (None, not auto) if cfg["SPLIT_K"] > 1 else (None,)
        for _ in range(trials):
            idx = torch.randperm(POOL, generator=gen)[:m].to(pool.device)
            for across in modes:
                bad = bits_differ(bim.matmul(pool[idx], w, None, cfg, across=across), alone[idx])
                if bad.any():
                    mode = "across" if (auto if across is None else across) else "in-program"
                    forced = "" if across is None else "forced "
                    failures.append(f"M={m} {forced}{mode}: {int(bad.sum())} of {m} rows differ")
    return failures, err


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidates", default=",".join(bim.CANDIDATES), help="comma-separated names of CANDIDATES")
    p.add_argument("--shapes", default=LLAMA, help=f"comma-separated names of {', '.join(SHAPES)}")
    p.add_argument("--time-rows", default="1,8,64,256,2048")
    p.add_argument("--trials", type=int, default=2, help="random batches per M in the invariance check")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--no-pdl", action="store_true")
    p.add_argument("--json", default=None, help="append the results as a JSON line to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the interpreter checks are tests/test_batch_invariant_kernels.py)")
        return 2
    t_start = time.perf_counter()
    dtype = DTYPES[args.dtype]
    names = args.candidates.split(",")
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    time_rows = [int(r) for r in args.time_rows.split(",")]
    pdl.enable(not args.no_pdl and torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    failures: dict[str, list] = {name: [] for name in names}
    errors: dict[str, float] = {name: 0.0 for name in names}
    us: dict[tuple, float] = {}  # (candidate or "cublas", shape, M) -> microseconds
    other_mode: dict[tuple, tuple] = {}  # (shape, M) -> (auto mode, its us, other mode's us) for DEFAULT
    for shape, (n, k) in shapes.items():
        w = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
        pool = torch.randn(POOL, k, device="cuda").to(dtype)
        configs = {name: bim.CANDIDATES[name](n, k, dtype) for name in names}
        print(f"{shape} [{n}x{k}] " + ", ".join(f"{name}: SPLIT_K {c['SPLIT_K']} BLOCK_N {c['BLOCK_N']}"
                                                for name, c in configs.items()), flush=True)  # fmt: skip
        for name, cfg in configs.items():
            fails, err = check(cfg, w, pool, args.trials, gen)
            tol = 2**-6 if dtype != torch.float32 else 1e-5
            if err > tol:
                fails.append(f"error {err:.2e} against F.linear")
            failures[name] += [f"{shape} {f}" for f in fails]
            errors[name] = max(errors[name], err)
            print(f"  {name}: {'ok' if not fails else 'FAILED ' + '; '.join(fails[:4])} (err {err:.1e}, "
                  f"{time.perf_counter() - t_start:.0f} s)", flush=True)  # fmt: skip
        copies = max(2, -(-256 * 2**20 // (n * k * w.element_size())))
        weights = [w] + [w.clone() for _ in range(copies - 1)]
        calls = max(copies, 16)
        for m in time_rows:
            x = torch.randn(m, k, device="cuda").to(dtype)
            us[("cublas", shape, m)] = graph_us(lambda wt: F.linear(x, wt), weights, calls)
            for name, cfg in configs.items():
                us[(name, shape, m)] = graph_us(lambda wt, c=cfg: bim.matmul(x, wt, None, c), weights, calls)
            cfg = bim.config_for(n, k, dtype)
            if cfg["SPLIT_K"] > 1:
                auto = bim.use_across(cfg, m, n, bim.row_tile(cfg, m, n))
                t_auto = graph_us(lambda wt: bim.matmul(x, wt, None, cfg), weights, calls)
                t_other = graph_us(lambda wt: bim.matmul(x, wt, None, cfg, across=not auto), weights, calls)
                other_mode[(shape, m)] = ("across" if auto else "in-program", t_auto, t_other)
            torch.cuda.empty_cache()
        del weights, w, pool
        torch.cuda.empty_cache()

    print(f"\n{torch.cuda.get_device_name()}, {args.dtype}, PDL {'on' if pdl.ENABLED else 'off'}: us per call "
          f"(ratio to cuBLAS)\n")  # fmt: skip
    score = report(names, shapes, time_rows, dtype, us, failures, errors, other_mode)
    print(f"({time.perf_counter() - t_start:.0f} s)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "pdl": pdl.ENABLED,
                                "us": {"|".join(map(str, key)): v for key, v in us.items()}, "score": score,
                                "failures": failures, "errors": errors}) + "\n")  # fmt: skip
    return 1 if any(failures.values()) else 0


def report(names, shapes, time_rows, dtype, us, failures, errors, other_mode) -> dict:
    """Prints the tables and the recommendation; returns each candidate's geometric-mean ratio to cuBLAS."""
    cols = ["cublas"] + names
    print("| shape | M | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    for shape, (n, k) in shapes.items():
        for m in time_rows:
            base = us[("cublas", shape, m)]
            cells = [f"{base:.1f}"] + [f"{us[(c, shape, m)]:.1f} ({us[(c, shape, m)] / base:.2f})" for c in names]
            print(f"| {shape} {n}x{k} | {m} | " + " | ".join(cells) + " |")
    ratios: dict[str, list] = {name: [] for name in names}
    for m in time_rows:
        base = sum(us[("cublas", s, m)] for s in shapes)
        cells = [f"{base:.1f}"]
        for c in names:
            total = sum(us[(c, s, m)] for s in shapes)
            ratios[c].append(total / base)
            cells.append(f"{total:.1f} ({total / base:.2f})")
        print(f"| all shapes | {m} | " + " | ".join(cells) + " |")
    score = {c: math.exp(sum(math.log(r) for r in ratios[c]) / len(ratios[c])) for c in names}
    print("| geomean ratio | | 1.00 | " + " | ".join(f"{score[c]:.3f}" for c in names) + " |")
    print("| invariant and accurate | | | " + " | ".join("yes" if not failures[c] else f"NO ({len(failures[c])})"
                                            for c in names) + " |")  # fmt: skip
    print("| max rel err | | | " + " | ".join(f"{errors[c]:.1e}" for c in names) + " |")
    if other_mode:
        print(f"\n{bim.DEFAULT} (DEFAULT), launch mode picked by M vs the other one, us:")
        for (shape, m), (mode, t_auto, t_other) in other_mode.items():
            flag = "  <- the other mode is faster" if t_other < 0.95 * t_auto else ""
            print(f"  {shape} M={m}: {mode} {t_auto:.1f}, other {t_other:.1f}{flag}")
    for c in names:
        for f in failures[c][:8]:
            print(f"FAILURE {c}: {f}")
    passed = [c for c in names if not failures[c]]
    by_construction = [c for c in passed if not bim.CANDIDATES[c](4096, 4096, dtype).get("ROW_TILES")]
    if passed:
        best = min(passed, key=score.get)
        print(f"\nmake the default: {best} (geomean {score[best]:.3f} x cuBLAS; DEFAULT now {bim.DEFAULT})")
        if best not in by_construction:
            alt = min(by_construction, key=score.get) if by_construction else None
            print(f"  {best} changes BLOCK_M with M: bitwise equal on this GPU and these shapes only; the best "
                  f"candidate invariant by construction is {alt} ({score[alt]:.3f})" if alt else "")  # fmt: skip
    else:
        print("\nno candidate passed")
    return score


if __name__ == "__main__":
    sys.exit(main())
