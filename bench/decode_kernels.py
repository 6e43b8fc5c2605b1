"""Batch-1 decode kernels on the GPU (Llama-3-8B shapes, bf16), in one command:

    PYTHONPATH=. python bench/decode_kernels.py --out DIR [--sections gemv,pdl,prefill,e2e] [--quick]

pdl      the default GEMV per shape back to back in a CUDA graph, programmatic dependent launch off / on.
gemv     M = 1 linears: aserve/kernels/gemv.py (a sweep of launch configurations) vs cuBLAS (F.linear), each timed
         inside a CUDA graph that cycles through enough weight copies (>= 256 MB) that L2 holds none of them; GB/s of
         weight bytes read.
prefill  prefill attention, one 4096-token causal prompt: kernel variants (keys gathered from the pages or the
         prompt's own K/V read from qkv rows as the engine does; stages) vs torch SDPA (flash), alternating, best
         of 3 each.
silu     the down projection's GEMV with SiLU·mul fused in: launch-config sweep (aserve/kernels/gemv.py
         GEMV_CONFIG_SILU_MUL).
sample   the greedy pick (aserve/kernels/greedy.py) vs the sampler's torch path on [1 / 8 / 64, 128256] bf16 logits, and
         bf16 batch-1 decode with and without it
fp8_attention  decode attention over an FP8 e4m3 cache (bf16 queries): dots in bf16 or fp16, tile widths, stages
e2e      engines side by side (E2E_VARIANTS: Triton GEMV + PDL, the same with the SiLU·mul GEMV on the plain
         config, cuBLAS without PDL; ASERVE_GEMV / ASERVE_PDL), alternating batch-1 decode ms/token
         (gpu_bench.batch1_decode_ms), the captured forward's GPU time, the GPU kernels of one decode step, and the
         GPU's idle time between kernels during a 64-token decode (profiler timeline).
Prints a table last; writes results.json under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402

from aserve.kernels import pdl  # noqa: E402
from aserve.kernels.gemv import gemv, gemv_config  # noqa: E402
from aserve.kernels.paged_attention import paged_attention, tile_config  # noqa: E402
from aserve.kernels.split_kv import attention_counters  # noqa: E402

SHAPES = {  # name: (N, K) of the weight
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096),
}  # fmt: skip
TABLE: list[tuple[str, str]] = []
RESULTS: dict = {}


def graph_us(fn, weights, calls: int) -> float:
    """GPU time of one call, from a CUDA graph of `calls` calls cycling through `weights`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    for _ in range(3):
        graph.replay()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (5 * calls))
    del graph
    return best


def shape_case(n: int, k: int):
    """Weight copies of an [n, k] linear totalling >= 256 MB (so L2 holds none), an input row, calls per graph."""
    nbytes = n * k * 2
    copies = max(2, -(-256 * 2**20 // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    return nbytes, weights, torch.randn(1, k, device="cuda", dtype=torch.bfloat16), max(copies, 16)


def section_gemv(quick: bool) -> None:
    configs = [
        dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
        for bn in ((8, 16) if quick else (4, 8, 16, 32))
        for bk in ((512,) if quick else (256, 512, 1024))
        for w in (4, 8)
        for s in ((2,) if quick else (1, 2, 3))
    ]
    totals = {"cublas": 0.0, "gemv_default": 0.0, "gemv_best": 0.0}
    per_config_total: dict[str, float] = {}
    weight = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}  # calls per decode step
    for name, (n, k) in SHAPES.items():
        nbytes, weights, x, calls = shape_case(n, k)
        ref = F.linear(x, weights[0]).float()
        t_cublas = graph_us(lambda w: F.linear(x, w), weights, calls)
        rows = []
        for cfg in configs:
            c = gemv_config(n, k, cfg)
            if c is None:
                continue
            try:
                err = ((gemv(x, weights[0], config=c).float() - ref).norm() / ref.norm()).item()
                us = graph_us(lambda w, c=c: gemv(x, w, config=c), weights, calls)
            except Exception as e:  # noqa: BLE001  (out of resources)
                print(f"{name} {cfg} failed: {type(e).__name__}", flush=True)
                continue
            rows.append((us, cfg, err))
            key = str(sorted(cfg.items()))
            per_config_total[key] = per_config_total.get(key, 0.0) + us * weight[name]
        rows.sort(key=lambda r: r[0])
        t_default = graph_us(lambda w: gemv(x, w), weights, calls)
        totals["cublas"] += t_cublas * weight[name]
        totals["gemv_default"] += t_default * weight[name]
        totals["gemv_best"] += rows[0][0] * weight[name]
        RESULTS[f"gemv_{name}"] = dict(cublas_us=t_cublas, default_us=t_default, best=rows[:5])
        gbps = lambda us: nbytes / us / 1e3  # noqa: E731
        print(f"{name} [{n}x{k}]: cuBLAS {t_cublas:.2f} us ({gbps(t_cublas):.0f} GB/s); default {t_default:.2f} us "
              f"({gbps(t_default):.0f} GB/s); best {rows[0][0]:.2f} us ({gbps(rows[0][0]):.0f} GB/s) {rows[0][1]} "
              f"err {rows[0][2]:.1e}", flush=True)  # fmt: skip
        for us, cfg, err in rows[:6]:
            print(f"   {us:.2f} us {gbps(us):.0f} GB/s {cfg} err {err:.1e}", flush=True)
        TABLE.append((f"gemv {name} [{n}x{k}] us: cuBLAS / default / best",
                      f"{t_cublas:.2f} / {t_default:.2f} / {rows[0][0]:.2f} ({gbps(t_cublas):.0f} / "
                      f"{gbps(t_default):.0f} / {gbps(rows[0][0]):.0f} GB/s)"))  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    best_one = min(per_config_total.items(), key=lambda kv: kv[1])
    RESULTS["gemv_step_totals_us"] = totals
    RESULTS["gemv_best_single_config"] = best_one
    TABLE.append(("linears of one decode step, ms: cuBLAS / default / per-shape best",
                  f"{totals['cublas'] / 1e3:.3f} / {totals['gemv_default'] / 1e3:.3f} / "
                  f"{totals['gemv_best'] / 1e3:.3f}"))  # fmt: skip
    TABLE.append(("best single config for all shapes", f"{best_one[0]}: {best_one[1] / 1e3:.3f} ms"))


def section_silu() -> None:
    n, k = SHAPES["down"]
    nbytes, weights, _, calls = shape_case(n, k)
    x = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(F.silu(x[:, :k].float()) * x[:, k:].float(), weights[0].float())
    pdl.enable(True)
    rows = []
    for bn, bk, w, st in itertools.product((4, 8, 16, 32), (512, 1024, 2048), (4, 8), (2, 3, 4)):
        cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
        try:
            err = ((gemv(x, weights[0], config=cfg, silu_mul=True).float() - ref).norm() / ref.norm()).item()
            rows.append((graph_us(lambda wt, c=cfg: gemv(x, wt, config=c, silu_mul=True), weights, calls), cfg, err))
        except Exception as e:  # noqa: BLE001  (out of resources)
            print(f"silu {cfg} failed: {type(e).__name__}", flush=True)
    t_default = graph_us(lambda wt: gemv(x, wt, silu_mul=True), weights, calls)
    t_plain_cfg = graph_us(lambda wt: gemv(x, wt, config=gemv_config(n, k), silu_mul=True), weights, calls)
    pdl.enable(False)
    rows.sort(key=lambda r: r[0])
    for us, cfg, err in rows[:8]:
        print(f"   silu {us:.2f} us {nbytes / us / 1e3:.0f} GB/s {cfg} err {err:.1e}", flush=True)
    RESULTS["silu_down"] = dict(default_us=t_default, plain_config_us=t_plain_cfg, best=rows[:8])
    TABLE.append(
        (
            "down + SiLU·mul GEMV us: plain config / GEMV_CONFIG_SILU_MUL / best (config)",
            f"{t_plain_cfg:.2f} / {t_default:.2f} / {rows[0][0]:.2f} ({rows[0][1]})",
        )
    )
    del weights
    torch.cuda.empty_cache()


# One config for every shape: the baseline that gemv_config's per-shape rule is compared with
OLD_DEFAULT = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=2)


def section_pdl() -> None:
    """Each M = 1 shape with its default configuration and the first one's, back to back in a CUDA graph, without
    and with programmatic dependent launch (the next GEMV's launch overlaps the previous one's tail)."""
    for name, (n, k) in SHAPES.items():
        nbytes, weights, x, calls = shape_case(n, k)
        t: dict[str, float] = {}
        for _ in range(2):
            for cfg_name, cfg in (("rule", gemv_config(n, k)), ("old", OLD_DEFAULT)):
                for on in (False, True):
                    pdl.enable(on)
                    key = f"{cfg_name} pdl={int(on)}"
                    t[key] = min(t.get(key, 1e9), graph_us(lambda w, cfg=cfg: gemv(x, w, config=cfg), weights, calls))
        pdl.enable(False)
        RESULTS[f"pdl_gemv_{name}"] = t
        TABLE.append(
            (
                f"gemv {name} [{n}x{k}] us, PDL off/on: " + ", ".join(sorted({k_[:-6] for k_ in t})),
                ", ".join(f"{t[k_ + ' pdl=0']:.2f}/{t[k_ + ' pdl=1']:.2f}" for k_ in sorted({k_[:-6] for k_ in t})),
            )
        )
        del weights
        torch.cuda.empty_cache()


def section_prefill() -> None:
    H, Hkv, D, bs, T = 32, 8, 128, 16, 4096
    torch.manual_seed(0)
    (q, k_cache, v_cache, table, seq, qsl), (qs, ks, vs), flops = gb.prefill_case(T, H, Hkv, D, bs)
    k_new, v_new = gb.prefill_new_kv(q, k_cache, v_cache)
    base = dict(BLOCK_M=128, TILE_N=128, num_warps=8, REVERSE=True, ACC_DOT=True)
    variants = {f"{src} stages={s}": (dict(base, num_stages=s), src) for src in ("pages", "qkv_rows") for s in (2, 3)}
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1).float()
    best = {name: float("inf") for name in ["sdpa", *variants]}
    for _ in range(3):
        best["sdpa"] = min(
            best["sdpa"],
            triton.testing.do_bench(
                lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True), warmup=25, rep=200
            ),
        )
        for name, (cfg, src) in variants.items():
            kv = dict(k_new=k_new, v_new=v_new) if src == "qkv_rows" else {}
            best[name] = min(best[name], triton.testing.do_bench(
                lambda cfg=cfg, kv=kv: paged_attention(q, k_cache, v_cache, table, seq, qsl, T, config=cfg, **kv),
                warmup=25, rep=200))  # fmt: skip
    for name, (cfg, src) in variants.items():
        kv = dict(k_new=k_new, v_new=v_new) if src == "qkv_rows" else {}
        out = paged_attention(q, k_cache, v_cache, table, seq, qsl, T, config=cfg, **kv).float()
        err = ((out - ref).norm() / ref.norm()).item()
        tf = flops / best[name] / 1e9
        RESULTS[f"prefill {name}"] = dict(tflops=tf, vs_sdpa=best["sdpa"] / best[name], err=err)
        TABLE.append((f"prefill attn {name}", f"{tf:.1f} TFLOP/s = {best['sdpa'] / best[name]:.3f}x SDPA, "
                                               f"err {err:.1e}"))  # fmt: skip
    TABLE.append(("prefill attn SDPA flash", f"{flops / best['sdpa'] / 1e9:.1f} TFLOP/s"))


def idle_between_kernels(llm) -> dict:
    """GPU busy/idle time over a 64-token batch-1 decode (after the prompt), from the profiler's kernel timeline."""
    from torch.profiler import ProfilerActivity, profile

    from aserve import SamplingParams

    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, cur_s, cur_e = 0.0, *spans[0]
    gaps = []
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    gaps.sort(reverse=True)
    span = spans[-1][1] - spans[0][0]
    return dict(
        span_ms=span / 1e3,
        busy_ms=busy / 1e3,
        idle_ms=(span - busy) / 1e3,
        kernels=len(spans),
        gaps_over_20us=sum(1 for g in gaps if g > 20),
        largest_gaps_us=gaps[:8],
    )


def _old_silu_config(llm) -> None:
    """The down projection's SiLU·mul GEMV on the plain config (as before GEMV_CONFIG_SILU_MUL)."""
    from aserve.layers.linear import Linear

    for m in llm.engine.core.runner.model.modules():
        if isinstance(m, Linear):
            m.gemv_silu_config = None
    llm.engine.core.runner.capture_cuda_graphs()


E2E_VARIANTS = {  # name: (environment of the engine (loader switches), change after loading)
    "gemv": ({"ASERVE_GEMV": "1", "ASERVE_PDL": "1"}, None),
    "gemv_old_silu_config": ({"ASERVE_GEMV": "1", "ASERVE_PDL": "1"}, _old_silu_config),
    "cublas": ({"ASERVE_GEMV": "0", "ASERVE_PDL": "0"}, None),
}  # fmt: skip


def section_e2e(repeats: int) -> None:
    from aserve import LLM

    model_dir = gb.dummy_model_dir(tempfile.mkdtemp())
    engines, pdl_of = {}, {}
    for name, (env, post) in E2E_VARIANTS.items():
        os.environ.update(env)
        t0 = time.perf_counter()
        engines[name] = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
                            kv_cache_memory_gb=8)  # fmt: skip
        pdl_of[name] = pdl.ENABLED  # the eager kernels (lm_head, prefill) follow the global switch
        if post is not None:
            post(engines[name])
        print(f"{name}: engine up in {time.perf_counter() - t0:.1f} s (pdl {pdl.ENABLED})", flush=True)
        for key in env:
            del os.environ[key]
    ms = {name: [] for name in engines}
    for r in range(repeats):
        for name, llm in engines.items():
            pdl.enable(pdl_of[name])
            ms[name].append(gb.batch1_decode_ms(llm))
            print(f"repeat {r} {name}: {ms[name][-1]:.3f} ms/token", flush=True)
    outs = {}
    for name, llm in engines.items():
        from aserve import SamplingParams

        pdl.enable(pdl_of[name])
        prompt = {"prompt_token_ids": list(range(2000, 2128))}
        outs[name] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
        graphs = llm.engine.core.runner.graphs
        fwd = gb.bench_ms(graphs.graphs[(1, 1)][0].replay) if graphs is not None else float("nan")
        gb.RESULTS.clear()
        if graphs is not None:
            gb.top_kernels(lambda: graphs.graphs[(1, 1)][0].replay(), "k", n=20)
        idle = idle_between_kernels(llm)
        RESULTS[f"e2e_{name}"] = dict(ms_per_token=ms[name], graph_forward_ms=fwd, idle=idle,
                                      kernels=gb.RESULTS.get("k"))  # fmt: skip
        print(f"{name}: kernels {gb.RESULTS.get('k')}\n{name}: idle {idle}", flush=True)
        TABLE.append((f"e2e {name}: batch-1 ms/token (median of {repeats}); graph forward ms",
                      f"{sorted(ms[name])[len(ms[name]) // 2]:.3f} (all {[round(v, 3) for v in ms[name]]}); "
                      f"{fwd:.3f}"))  # fmt: skip
        TABLE.append(
            (
                f"e2e {name}: 64-token decode GPU span / busy / idle ms, kernels",
                f"{idle['span_ms']:.2f} / {idle['busy_ms']:.2f} / {idle['idle_ms']:.2f}, {idle['kernels']}",
            )
        )
    for name in outs:
        same = next((i for i, (a, b) in enumerate(zip(outs[name], outs["cublas"])) if a != b), None)
        TABLE.append((f"greedy 64 tokens, first difference {name} vs cuBLAS", str(same)))


def section_sample(repeats: int) -> None:
    """The greedy pick (aserve/kernels/greedy.py) vs the sampler's torch path (float32 copy, a sum for the finite check,
    max(dim).indices) on bf16 logits [rows, 128256], eager as the sampler runs (CUDA events over 200 calls); then
    batch-1 decode of the bf16 Llama-3-8B shape with the pick and without (Sampler._greedy_pick patched to the
    CPU-only rule), alternating."""
    from aserve import LLM
    from aserve.kernels import greedy
    from aserve.worker.sampler import Sampler

    def torch_path(logits):
        x = logits.float()
        return x.max(dim=-1).indices, ~torch.isfinite(x.sum(dim=-1, dtype=torch.float32))

    for rows in (1, 8, 64):
        logits = torch.randn(rows, 128256, device="cuda").to(torch.bfloat16)
        assert torch.equal(greedy.greedy_pick(logits)[0], torch_path(logits)[0])
        us = {}
        for name, fn in (("torch", torch_path), ("greedy_pick", greedy.greedy_pick)):
            for _ in range(10):
                fn(logits)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                fn(logits)
            end.record()
            end.synchronize()
            us[name] = start.elapsed_time(end) * 1e3 / 200
        TABLE.append((f"greedy pick, bf16 [{rows}, 128256]: torch path / aserve/kernels/greedy.py us",
                      f"{us['torch']:.1f} / {us['greedy_pick']:.1f}"))  # fmt: skip
        print(TABLE[-1], flush=True)
    model_dir = gb.dummy_model_dir(tempfile.mkdtemp())
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
              kv_cache_memory_gb=8)  # fmt: skip
    pick = Sampler.__dict__["_greedy_pick"]  # the staticmethod itself
    ms = {"pick": [], "torch": []}
    try:
        for _ in range(repeats):
            for name in ms:
                Sampler._greedy_pick = pick if name == "pick" else staticmethod(lambda logits, rows: None)
                ms[name].append(gb.batch1_decode_ms(llm))
                print(f"{name}: {ms[name][-1]:.3f} ms/token", flush=True)
    finally:
        Sampler._greedy_pick = pick
    for name, v in ms.items():
        TABLE.append((f"bf16 batch-1 decode, greedy {name}: ms/token (median of {repeats})",
                      f"{sorted(v)[len(v) // 2]:.3f} (all {[round(x, 3) for x in v]})"))  # fmt: skip
    RESULTS["sample_decode_ms"] = ms


def section_fp8_attention() -> None:
    """Decode attention over an FP8 e4m3 cache (64 sequences x 4096 keys, bf16 queries): the dots in bf16 (tiles
    converted to q's dtype) or in fp16 (FP16_DOT), by tile width, stages, warps and split-KV segments, vs the bf16
    cache's default."""
    H, Hkv, D, bs, B, ctx = 32, 8, 128, 16, 64, 4096
    torch.manual_seed(0)
    nblk = B * ctx // bs
    k16, v16 = (torch.randn(nblk, bs, Hkv, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k8, v8 = (c.float().div(2.0).clamp(-448, 448).to(torch.float8_e4m3fn) for c in (k16, v16))
    tables = torch.randperm(nblk, device="cuda").view(B, ctx // bs).int()
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    bw = gb.RESULTS.get("copy_bandwidth", {}).get("value", 4.27)
    ms = triton.testing.do_bench(lambda: paged_attention(q, k16, v16, tables, seq_lens, qsl, 1), warmup=25, rep=100)
    TABLE.append(("decode attn bf16 cache (default)", f"{2 * k16.nbytes / ms / 1e9:.2f} TB/s ({ms * 1e3:.0f} us)"))
    ref = paged_attention(q, k8, v8, tables, seq_lens, qsl, 1, config=dict(tile_config(H, Hkv, 1), FP16_DOT=True),
                          k_scale=2.0, v_scale=2.0).float()  # fmt: skip
    grid = [(False, tile_n, stages, 4, 1) for tile_n, stages in itertools.product((64, 128), (2, 3))]
    grid += list(itertools.product((True,), (64, 128, 256), (2, 3, 4), (4, 8), (1, 2)))
    for fp16, tile_n, stages, warps, segments in grid:
        cfg = dict(tile_config(H, Hkv, 1), TILE_N=tile_n, num_stages=stages, num_warps=warps, FP16_DOT=fp16)
        split = {}
        if segments > 1:
            split = dict(num_segments=segments, counters=attention_counters(2 * B, Hkv, "cuda"), partials=(
                torch.empty(B, H, segments, D, dtype=torch.float32, device="cuda"),
                torch.empty(B, H, segments, 2, dtype=torch.float32, device="cuda")))  # fmt: skip

        def run(cfg=cfg, split=split):
            return paged_attention(q, k8, v8, tables, seq_lens, qsl, 1, config=cfg, k_scale=2.0, v_scale=2.0, **split)

        try:
            out = run().float()
            ms = triton.testing.do_bench(run, warmup=25, rep=100)
        except Exception as e:  # noqa: BLE001 (out of shared memory)
            print("   fp8 config failed", cfg, segments, type(e).__name__, flush=True)
            continue
        rate = 2 * k8.nbytes / ms / 1e9
        err = ((out - ref).norm() / ref.norm()).item()
        name = f"fp16={fp16} tile_n={tile_n} stages={stages} warps={warps} segments={segments}"
        RESULTS[f"fp8 attn {name}"] = dict(tb_s=rate, us=ms * 1e3, err=err)
        note = f"{rate:.2f} TB/s = {100 * rate / bw:.0f}% of copy ({ms * 1e3:.0f} us), vs fp16 dot {err:.1e}"
        TABLE.append((f"decode attn fp8 cache {name}", note))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--sections", default="gemv,pdl,prefill,e2e")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for section in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            {"gemv": lambda: section_gemv(args.quick), "pdl": section_pdl, "prefill": section_prefill,
             "silu": section_silu, "sample": lambda: section_sample(args.repeats),
             "fp8_attention": section_fp8_attention, "e2e": lambda: section_e2e(args.repeats)}[section]()  # fmt: skip
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            TABLE.append((f"{section} FAILED", f"{type(e).__name__}: {e}"[:200]))
        print(f"section {section}: {time.perf_counter() - t0:.0f} s", flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print("\n| measurement | value |\n|---|---|")
    for k, v in TABLE:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
