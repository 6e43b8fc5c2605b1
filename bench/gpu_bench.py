"""GPU benchmarks for a Llama-3-8B-shaped model with random weights (bf16), in one command:

    python bench/gpu_bench.py --out DIR [--sections ceilings,kernels,prefill,parity,decode,throughput,hf]
        [--arch qwen3-8b|qwen3-30b-a3b|gemma3-12b|mixtral-8x7b] [--quantization fp8|int8] [--kv-cache-dtype fp8]
        [--quantize-lm-head]

ceilings    device-to-device copy bandwidth and bf16 matmul rate (the two roofs everything is judged against)
kernels     decode attention (batch 64, 4096-token contexts; bf16 and FP8 e4m3 caches) vs copy bandwidth
prefill     prefill attention (4096 causal) vs torch SDPA (flash) on the same shape, and a sweep of its tile configs
parity      a tiny random Llama in bf16 and fp32 on the GPU: aserve's greedy tokens vs transformers'
decode      batch-1 decode, 128 prompt tokens, 256 generated: ms/token vs weights_bytes / copy bandwidth
throughput  256 requests x 512 prompt / 256 output tokens (EOS ignored): aserve output tok/s
hf          the same workload with transformers generate (static batches of 64) and generate_batch
verify_cost step time with B requests of k+1 tokens vs 1 (speculative verification), B = 1..256, k = 0..4
Prints a table last; writes results.json (and logs) under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_profile import kernel_times  # noqa: E402

LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=128000,
    eos_token_id=128001, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip

QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, bos_token_id=151643,
    eos_token_id=151645, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    use_sliding_window=False,
)  # fmt: skip

# Gemma-3-12B: five sliding-window layers (1024 keys) to one global one (linear-scaled rotary); bench/sliding_window.py
GEMMA3_12B = dict(
    vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=2,
    eos_token_id=[1, 106], query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
)  # fmt: skip

# Mixtral-8x7B: 8 experts of 14,336, top 2 (93 GB in bf16); experts through torch._grouped_mm (moe_grouped_mm.py)
MIXTRAL_8X7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)  # fmt: skip

MAX_PROMPT_ID = 100000  # random prompt ids stay below this and below the model's vocabulary
ARCHS = {"llama3-8b": ("LlamaConfig", LLAMA3_8B), "qwen3-8b": ("Qwen3Config", QWEN3_8B),
         "mixtral-8x7b": ("MixtralConfig", MIXTRAL_8X7B),
         "gemma3-12b": ("Gemma3TextConfig", GEMMA3_12B),
         "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(QWEN3_8B, hidden_size=2048, intermediate_size=6144,
                           num_hidden_layers=48, num_key_value_heads=4, moe_intermediate_size=768, num_experts=128,
                           num_experts_per_tok=8, norm_topk_prob=True))}  # fmt: skip

RESULTS: dict = {}
ENGINE_KW: dict = {}  # extra LLM arguments of the decode and throughput sections (--quantization)


def record(key: str, value, unit: str = "", note: str = "") -> None:
    RESULTS[key] = {"value": value, "unit": unit, "note": note}
    print(f"  {key}: {value} {unit} {note}", flush=True)


def run_section(name: str, fn) -> None:
    """Runs one benchmark section; a failure is recorded and the next section still runs."""
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:
        import traceback

        traceback.print_exc()
        record(f"{name}_error", f"{type(e).__name__}: {str(e)[:300]}")
    gc.collect()
    torch.cuda.empty_cache()
    print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)


def write_results(out_dir: str) -> None:
    """results.json under out_dir, and the results table on stdout."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    print("\n| result | value | note |\n|---|---|---|")
    for key, r in RESULTS.items():
        print(f"| {key} | {r['value']} {r['unit']} | {r['note']} |")


def bench_ms(fn, warmup_ms=50, rep_ms=300) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def dummy_model_dir(root: str, arch: str = "llama3-8b") -> str:
    """config.json of the architecture's shape plus a small real tokenizer: enough for load_format=dummy."""
    import transformers
    from tiny_models import build_tokenizer

    config_class, config = ARCHS[arch]
    path = os.path.join(root, f"{arch}-shape")
    getattr(transformers, config_class)(**config).save_pretrained(path)
    build_tokenizer(path)
    return path


# -- sections ---------------------------------------------------------------------------------------------------


def ceilings() -> None:
    n = 2 << 30
    src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    record("copy_bandwidth", round(2 * n / ms / 1e9, 2), "TB/s", "(bytes read + written)")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = bench_ms(lambda: a @ b)
    record("bf16_matmul", round(2 * 8192**3 / ms / 1e9, 1), "TFLOP/s", "(8192^3, random data)")


def prefill_case(T: int, H: int, Hkv: int, D: int, bs: int):
    """One T-token causal prompt in contiguous pages, bf16 on the GPU. -> (paged_attention's inputs (q, k_cache,
    v_cache, block table, seq_lens, query_start_loc), the same as SDPA's [1, heads, T, D] views, causal FLOPs)."""
    k_cache = torch.randn(T // bs, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(T // bs, dtype=torch.int32, device="cuda").view(1, -1)
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    seq = torch.tensor([T], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    sdpa_views = tuple(x.transpose(0, 1).unsqueeze(0) for x in (q, k_cache.view(T, Hkv, D), v_cache.view(T, Hkv, D)))
    return (q, k_cache, v_cache, table, seq, qsl), sdpa_views, 4 * T * T * D * H / 2


def prefill_new_kv(q, k_cache, v_cache):
    """The prompt's K/V as the engine hands them to paged_attention (k_new / v_new): slices of fused qkv rows
    [T, (H + 2 Hkv) D] holding the same values as the pages."""
    from aserve.kernels.fused import qkv_kv_views

    T, H, D = q.shape
    qkv = torch.cat([q.reshape(T, -1), k_cache.reshape(T, -1), v_cache.reshape(T, -1)], 1)
    return qkv_kv_views(qkv, H, k_cache.shape[2], D)


def kernels() -> None:
    import torch.nn.functional as F

    from aserve.kernels.paged_attention import paged_attention

    torch.manual_seed(0)
    H, Hkv, D, bs = 32, 8, 128, 16
    bw = RESULTS.get("copy_bandwidth", {}).get("value", 4.3)
    # Decode: 64 sequences x 4096 context, blocks scattered over the pool.
    B, ctx = 64, 4096
    nblk = B * ctx // bs
    k_cache = torch.randn(nblk, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(nblk, device="cuda").view(B, ctx // bs).int()
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    kv_bytes = 2 * B * ctx * Hkv * D * 2

    def decode_rates(name: str, k, v, nbytes: int, **scales) -> None:
        for segments in (1, 2, 4):
            ms = bench_ms(lambda: paged_attention(q, k, v, tables, seq_lens, qsl, 1, num_segments=segments, **scales))
            record(f"{name}_b64_ctx4096_seg{segments}", round(nbytes / ms / 1e9, 2), "TB/s",
                   f"({ms * 1e3:.0f} us, {100 * nbytes / ms / 1e9 / bw:.0f}% of copy bandwidth)")  # fmt: skip

    decode_rates("decode_attn", k_cache, v_cache, kv_bytes)
    # Correctness at full shape against SDPA on the same (gathered) data.
    kg = k_cache[tables.long()].view(B, ctx, Hkv, D).transpose(1, 2)
    vg = v_cache[tables.long()].view(B, ctx, Hkv, D).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.unsqueeze(2), kg, vg, enable_gqa=True).squeeze(2)
    out = paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 1)
    record("decode_attn_rel_err", f"{((out.float() - ref.float()).norm() / ref.float().norm()).item():.2e}")
    # The same decode over an FP8 e4m3 cache (--kv-cache-dtype fp8): half the bytes, per-tensor scales.
    k8, v8 = [c.float().div(2.0).clamp(-448, 448).to(torch.float8_e4m3fn) for c in (k_cache, v_cache)]
    decode_rates("decode_attn_fp8kv", k8, v8, kv_bytes // 2, k_scale=2.0, v_scale=2.0)
    out8 = paged_attention(q, k8, v8, tables, seq_lens, qsl, 1, k_scale=2.0, v_scale=2.0)
    record("decode_attn_fp8kv_rel_err", f"{((out8.float() - ref.float()).norm() / ref.float().norm()).item():.2e}")


def prefill() -> None:
    """Prefill attention: one 4096-token causal sequence, against SDPA (flash), and a sweep of tile configs."""
    import torch.nn.functional as F

    from aserve.kernels.paged_attention import paged_attention

    torch.manual_seed(0)
    H, Hkv, D, bs, T = 32, 8, 128, 16, 4096
    (q, k_cache, v_cache, table, seq, qsl), (qs, ks, vs), flops = prefill_case(T, H, Hkv, D, bs)
    k_new, v_new = prefill_new_kv(q, k_cache, v_cache)  # the engine's path: the prompt's own K/V from qkv rows
    ms_tri = bench_ms(lambda: paged_attention(q, k_cache, v_cache, table, seq, qsl, T, k_new=k_new, v_new=v_new))
    ms_paged = bench_ms(lambda: paged_attention(q, k_cache, v_cache, table, seq, qsl, T))
    ms_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    out = paged_attention(q, k_cache, v_cache, table, seq, qsl, T, k_new=k_new, v_new=v_new)
    record("prefill_attn_4096_triton", round(flops / ms_tri / 1e9, 1), "TFLOP/s",
           f"({ms_tri * 1e3:.0f} us; the prompt's K/V from the qkv rows, as in the engine)")  # fmt: skip
    record("prefill_attn_4096_triton_pages", round(flops / ms_paged / 1e9, 1), "TFLOP/s",
           f"({ms_paged * 1e3:.0f} us; every key gathered from the pages)")  # fmt: skip
    tuning = []
    for block_m, reverse in ((64, False), (128, False), (64, True), (128, True)):
        for tile_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    cfg = dict(BLOCK_M=block_m, TILE_N=tile_n, num_warps=warps, num_stages=stages, REVERSE=reverse)

                    def run(cfg=cfg):
                        return paged_attention(q, k_cache, v_cache, table, seq, qsl, T, config=cfg, k_new=k_new,
                                               v_new=v_new)  # fmt: skip

                    try:
                        tuning.append((bench_ms(run, 25, 100), cfg))
                    except Exception as e:  # out of shared memory etc.
                        print("   config failed", cfg, type(e).__name__)
    tuning.sort(key=lambda x: x[0])
    for t, cfg in tuning[:5]:
        print(f"   prefill config {cfg}: {flops / t / 1e9:.1f} TFLOP/s", flush=True)
    record("prefill_attn_4096_best", round(flops / tuning[0][0] / 1e9, 1), "TFLOP/s", str(tuning[0][1]))
    record("prefill_attn_4096_sdpa", round(flops / ms_sdpa / 1e9, 1), "TFLOP/s", f"({ms_sdpa * 1e3:.0f} us)")
    record("prefill_attn_vs_sdpa", round(ms_sdpa / ms_tri, 3), "x", "(target >= 0.70)")
    record("prefill_attn_rel_err", f"{((out.float() - ref.float()).norm() / ref.float().norm()).item():.2e}")


def parity(root: str) -> None:
    from tiny_models import make_tiny_model
    from transformers import AutoModelForCausalLM

    from aserve import LLM, SamplingParams

    path = make_tiny_model(os.path.join(root, "tiny"), "gqa")
    prompts = [[(7 * i + 3 * j) % 380 + 2 for j in range(n)] for i, n in enumerate((5, 17, 40, 64))]
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dtype, max_model_len=512, gpu_memory_utilization=0.2)
        got = [
            o.outputs[0].token_ids
            for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
            )
        ]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
        agree, notes = 0, []
        for p, toks in zip(prompts, got):
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False, min_new_tokens=32
                )[0, len(p) :].tolist()
            if out == toks:
                agree += 1
                continue
            i = next(i for i, (a, b) in enumerate(zip(out, toks)) if a != b)
            with torch.no_grad():
                logits = model(torch.tensor([p + toks[:i]], device="cuda")).logits[0, -1].float()
            top = logits.topk(2)
            notes.append(f"diverged at {i}: hf top-2 logit gap {float(top.values[0] - top.values[1]):.4f}")
        record(f"parity_{dtype}_32_tokens", f"{agree}/{len(prompts)} identical", "", "; ".join(notes))
        del llm, model
        gc.collect()
        torch.cuda.empty_cache()


def top_kernels(fn, key: str, n: int = 10) -> None:
    """GPU time by kernel over 20 calls of fn (kernel_times), the first n recorded."""
    rows = kernel_times(fn)
    total = sum(r[1] for r in rows)
    lines = [f"{t / 1e3:.3f} ms x{c:g} {name[:70]}" for name, t, c in rows[:n]]
    record(key, f"{total / 1e3:.3f} ms total", "", " | ".join(lines))


def batch1_decode_ms(llm) -> float:
    """ms per generated token of batch-1 decode: 128 random prompt tokens, 256 generated, minus the time to the
    first token (a max_tokens=1 request); the median of 3, after a warm-up request."""
    from aserve import SamplingParams

    gen, high = torch.Generator().manual_seed(1), min(MAX_PROMPT_ID, llm.engine.config.vocab_size)
    prompt = lambda: {"prompt_token_ids": torch.randint(100, high, (128,), generator=gen).tolist()}  # noqa: E731
    llm.generate(prompt(), SamplingParams(max_tokens=8, ignore_eos=True))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompt(), SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
        e2e = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(prompt(), SamplingParams(max_tokens=1))
        times.append((e2e - (time.perf_counter() - t0)) / 255 * 1e3)
    return sorted(times)[1]


def decode(model_dir: str) -> None:
    from aserve import LLM

    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256, **ENGINE_KW)
    engine = llm.engine
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.core.runner.model.parameters())
    experts = [m for m in engine.core.runner.model.modules() if hasattr(m, "w13")]  # MoE: a token reads top_k of E
    weight_bytes -= sum((m.w13.nbytes + m.w2.nbytes) * (1 - m.top_k / m.num_experts) for m in experts)
    bw = RESULTS.get("copy_bandwidth", {}).get("value", 4.3)
    floor_ms = weight_bytes / (bw * 1e12) * 1e3
    ms = batch1_decode_ms(llm)
    graphs = engine.core.runner.graphs
    if graphs is not None:
        graph, _ = graphs.graphs[(1, 1)]
        fwd = bench_ms(graph.replay)
        note = f"(GPU time of the captured forward; {100 * floor_ms / fwd:.0f}% of floor)"
        record("decode_b1_graph_forward", round(fwd, 3), "ms", note)
        top_kernels(lambda: graphs.graphs[(1, 1)][0].replay(), "decode_b1_kernels")
    note = f"(floor {floor_ms:.2f} ms = {weight_bytes / 1e9:.2f} GB / {bw} TB/s; {100 * floor_ms / ms:.0f}% of floor)"
    record("decode_b1_ms_per_token", round(ms, 3), "ms", note)
    record("kv_capacity_tokens", engine.core.kv_capacity_tokens)
    return llm


def throughput(model_dir: str, llm=None) -> None:
    from aserve import LLM, SamplingParams

    if llm is None:
        llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256, **ENGINE_KW)
    high = min(MAX_PROMPT_ID, llm.engine.config.vocab_size)
    ids = torch.randint(100, high, (256, 512), generator=torch.Generator().manual_seed(2))
    prompts = [{"prompt_token_ids": row} for row in ids.tolist()]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    # Warm-up with the whole batch (few output tokens): Triton compiles its kernels' specialisations for the shapes
    # this workload reaches once per process; the timed run is the steady state a running server sees.
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.reset_prefix_cache()
    engine = llm.engine
    core = engine.core
    phases = {"schedule": [], "execute": [], "update": []}

    def timed(name, fn):
        def wrapper(*a):
            t = time.perf_counter()
            r = fn(*a)
            work = r if name == "schedule" else a[0]
            n = work.sched.num_tokens if work is not None and work.sched is not None else 0
            phases[name].append((time.perf_counter() - t, n))
            return r

        return wrapper

    # The engine core's phases, host time. With async scheduling, "execute" launches step N+1 and waits for step N's
    # tokens, and "update" applies step N.
    for name in phases:
        setattr(core, name, timed(name, getattr(core, name)))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for name in phases:
        delattr(core, name)  # back to the class's methods
    graphs = engine.core.runner.graphs
    if graphs is not None:
        top_kernels(lambda: graphs.graphs[(256, 256)][0].replay(), "decode_b256_kernels")
    decode_steps = [i for i, (_, n) in enumerate(phases["execute"]) if n == 256]
    prefill_steps = [i for i, (_, n) in enumerate(phases["execute"]) if n > 256]
    for name, values in phases.items():
        d = [values[i][0] for i in decode_steps if i < len(values)]  # (async: the phases' call counts may differ)
        p_ = [values[i][0] for i in prefill_steps if i < len(values)]
        record(
            f"step_{name}_ms",
            f"decode {1e3 * sum(d) / max(len(d), 1):.2f} x {len(d)}, "
            f"prefill {1e3 * sum(p_) / max(len(p_), 1):.2f} x {len(p_)}",
            "ms",
        )
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    record(
        "throughput_aserve",
        round(n_out / elapsed, 1),
        "out tok/s",
        f"({elapsed:.2f} s; roofline ~5.3 s = 12.4k tok/s: {100 * 5.3 / elapsed:.0f}%)",
    )


def verify_cost(model_dir: str) -> None:
    """Step time with B requests of k+1 query tokens each (speculative verification) relative to k = 0: the
    input the adaptive speculation policy needs. Eager steps (graphs only cover k = 0), requests without context."""
    from aserve import LLM

    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
              enforce_eager=True)  # fmt: skip
    runner = llm.engine.core.runner
    rows = []
    for batch in (1, 4, 16, 64, 256):
        times = []
        for k in range(5):
            fn = lambda: runner._synthetic_step([k + 1] * batch)  # noqa: E731
            times.append(bench_ms(fn, 20, 100))
        rows.append(
            f"B={batch}: "
            + " ".join(f"k{k}={t / times[0]:.2f}" for k, t in enumerate(times))
            + f" (k0 {times[0]:.2f} ms)"
        )
    record("verify_cost_relative", "see note", "", " | ".join(rows))


def hf(model_dir: str, generate_batch: bool = True) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(100, min(MAX_PROMPT_ID, cfg.vocab_size), (256, 512), generator=gen)
    with torch.no_grad():
        model.generate(prompts[:2].cuda(), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, 256, 64):
            ids = prompts[i : i + 64].cuda()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=256,
                min_new_tokens=256,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    record("throughput_hf_static64", round(256 * 256 / elapsed, 1), "out tok/s", f"({elapsed:.1f} s)")
    aserve = RESULTS.get("throughput_aserve", {}).get("value")
    if aserve:
        record("aserve_vs_hf_static", round(aserve / (256 * 256 / elapsed), 2), "x", "(target >= 5.5)")
    if not generate_batch:
        return
    try:
        gc = GenerationConfig(max_new_tokens=256, do_sample=False, eos_token_id=-1, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts.tolist(), generation_config=gc)
        elapsed = time.perf_counter() - t0
        n = sum(len(o.generated_tokens) for o in out.values())
        record("throughput_hf_generate_batch", round(n / elapsed, 1), "out tok/s", f"({elapsed:.1f} s, {n} tokens)")
    except Exception as e:  # API differences between transformers versions
        record("throughput_hf_generate_batch", "failed", "", f"{type(e).__name__}: {str(e)[:200]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="ceilings,kernels,prefill,parity,decode,throughput,hf")
    p.add_argument("--out", default=".")
    p.add_argument("--arch", default="llama3-8b", choices=list(ARCHS), help="the model shape (random weights)")
    p.add_argument("--quantization", default=None, help="decode / throughput with this method (fp8, int8)")
    p.add_argument("--kv-cache-dtype", default="auto", help="decode / throughput with this KV cache (auto, fp8)")
    p.add_argument("--quantize-lm-head", action="store_true", help="decode / throughput with a quantised lm_head")
    args = p.parse_args()
    ENGINE_KW["quantization"] = args.quantization
    ENGINE_KW["kv_cache_dtype"] = args.kv_cache_dtype
    ENGINE_KW["quantize_lm_head"] = args.quantize_lm_head
    sections = args.sections.split(",")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    root = tempfile.mkdtemp()
    model_dir = dummy_model_dir(root, args.arch)
    state = {"llm": None}

    def decode_section():
        state["llm"] = decode(model_dir)

    def throughput_section():
        throughput(model_dir, state.pop("llm", None))
        state["llm"] = None

    run = {
        "ceilings": ceilings,
        "kernels": kernels,
        "prefill": prefill,
        "parity": lambda: parity(root),
        "decode": decode_section,
        "throughput": throughput_section,
        "hf": lambda: hf(model_dir),
        "verify_cost": lambda: verify_cost(model_dir),
    }
    for name in sections:
        run_section(name, run[name])
    write_results(args.out)


if __name__ == "__main__":
    main()
