"""Sliding-window attention on the GPU: what Gemma 3's sliding layers save at a long context, in one command:

    PYTHONPATH=. python bench/sliding_window.py --out DIR [--context 16384] [--batches 1,8] [--sections ...]

ceilings  device-to-device copy bandwidth (gpu_bench's)
kernel    one layer's decode attention with Gemma-3-12B's heads (16 query, 8 KV of 256) over B contexts of --context
          tokens: a 1024-key window vs full attention; time, and the KV bytes each reads (the window's loop starts
          at the block holding its first key); the windowed output against SDPA over the last 1024 keys
decode    the engine's decode step (CUDA graphs, random weights, bf16) of the Gemma-3-12B shape (gpu_bench --arch
          gemma3-12b: 40 sliding layers of 1024 keys, 8 global) with B requests of --context prompt tokens, against
          the same model with every layer global: ms per step, and the KV bytes the step's attention reads
memory    the hybrid KV layout (aserve/core/kv_cache_groups.py: the 40 sliding layers' blocks behind their window go
          back while a request lives): in a cache of the bytes that hold 2 requests of --context tokens with one
          block table for all layers, how many such requests fit at once, computed and served (B = the largest of
          --batches requests of --context prompt tokens and 64 generated, all at once: preemptions counted)

Prints a table last; writes results.json under --out.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402

WINDOW = gb.GEMMA3_12B["sliding_window"]
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 256
DECODE_STEPS = 256


def kv_bytes(keys_per_layer: list[int], batch: int) -> int:
    """Bytes of K and V (bf16) one decode step of `batch` requests reads, given the keys each layer sees."""
    return 2 * batch * sum(keys_per_layer) * KV_HEADS * HEAD_DIM * 2


def keys_read(context: int, window: int | None, block_size: int = 16) -> int:
    """Keys the decode loop reads at `context`: all, or the window from the block holding its first key."""
    if window is None or context <= window:
        return context
    return context - (context - window) // block_size * block_size


def kernel(context: int, batches: list[int]) -> None:
    import torch.nn.functional as F

    from aserve.kernels.paged_attention import paged_attention
    from aserve.layers.attention.triton_backend import num_kv_segments

    bw = gb.RESULTS.get("copy_bandwidth", {}).get("value", 4.3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bs, scale = 16, 256**-0.5
    for batch in batches:
        torch.manual_seed(0)
        nblk = batch * context // bs
        k_cache = torch.randn(nblk, bs, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(nblk, device="cuda").view(batch, -1).int()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        times = {}
        for name, window in (("full", None), ("window", WINDOW)):
            keys = keys_read(context, window)
            segments = num_kv_segments(batch, KV_HEADS, keys, sms)  # as the backend picks them per layer

            def run(window=window, segments=segments):
                return paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 1, num_segments=segments,
                                       scale=scale, sliding_window=window)  # fmt: skip

            times[name] = ms = gb.bench_ms(run)
            read = kv_bytes([keys], batch)
            gb.record(f"attn_b{batch}_ctx{context}_{name}", round(ms * 1e3, 1), "us",
                      f"({read / 1e6:.0f} MB of KV, {read / ms / 1e9:.2f} TB/s = {100 * read / ms / 1e9 / bw:.0f}% "
                      f"of copy bandwidth; {segments} segments)")  # fmt: skip
        gb.record(f"attn_b{batch}_window_vs_full", round(times["window"] / times["full"], 3), "x",
                  f"(KV bytes {keys_read(context, WINDOW) / context:.3f}x)")  # fmt: skip
        out = paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 1, scale=scale, sliding_window=WINDOW)
        last = tables[:, -WINDOW // bs :].long()
        kg, vg = (c[last].view(batch, WINDOW, KV_HEADS, HEAD_DIM).transpose(1, 2) for c in (k_cache, v_cache))
        ref = F.scaled_dot_product_attention(q.unsqueeze(2), kg, vg, scale=scale, enable_gqa=True).squeeze(2)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        gb.record(f"attn_b{batch}_window_rel_err", f"{err:.2e}")


def full_attention_copy(model_dir: str, root: str) -> str:
    """The same shape with every layer global (config.layer_types all full_attention)."""
    import shutil

    path = os.path.join(root, "gemma3-12b-full-attention")
    shutil.copytree(model_dir, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def decode_step_ms(llm, context: int, batch: int) -> float:
    """ms per decode step of `batch` requests at `context` prompt tokens: (prefill + 1 + DECODE_STEPS tokens) minus
    (prefill + 1 token) on the same prompts (no prefix caching), the better of two."""
    from aserve import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(100, 100000, (context,), generator=gen).tolist()}
               for _ in range(batch)]  # fmt: skip
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (Triton specialisations)
    runs = []
    for _ in range(2):
        times = []
        for n in (1, 1 + DECODE_STEPS):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            times.append(time.perf_counter() - t0)
            lengths = {len(o.outputs[0].token_ids) for o in outs}
            assert lengths == {n}, f"asked for {n} tokens per request, got {lengths} (a failed step?)"
        runs.append((times[1] - times[0]) / DECODE_STEPS * 1e3)
    return min(runs)


def decode(context: int, batches: list[int], root: str) -> None:
    from aserve import LLM

    sliding_dir = gb.dummy_model_dir(root, "gemma3-12b")
    step_ms, step_bytes = {}, {}
    for name, path in (("sliding", sliding_dir), ("full", full_attention_copy(sliding_dir, root))):
        max_len = context + DECODE_STEPS + 16
        kv_gb = max(batches) * max_len * 48 * 2 * KV_HEADS * HEAD_DIM * 2 / 2**30 + 1
        llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=max_len, max_num_seqs=max(batches),
                  enable_prefix_caching=False, kv_cache_memory_gb=kv_gb)  # fmt: skip
        windows = [layer.self_attn.attn_params.sliding_window for layer in llm.engine.core.runner.model.layers]
        mid = context + DECODE_STEPS // 2  # the average context over the timed steps
        for batch in batches:
            step_ms[name, batch] = ms = decode_step_ms(llm, context, batch)
            step_bytes[name, batch] = read = kv_bytes([keys_read(mid, w) for w in windows], batch)
            sliding = sum(w is not None for w in windows)
            gb.record(f"decode_{name}_b{batch}_ctx{context}", round(ms, 3), "ms/step",
                      f"({sliding} sliding layers; KV read per step {read / 1e9:.2f} GB)")  # fmt: skip
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for batch in batches:
        bytes_ratio = step_bytes["sliding", batch] / step_bytes["full", batch]
        gb.record(f"decode_b{batch}_sliding_vs_full", round(step_ms["sliding", batch] / step_ms["full", batch], 3),
                  "x", f"(KV bytes {bytes_ratio:.3f}x; target <= 0.60)")  # fmt: skip


def memory(context: int, batch: int, root: str) -> None:
    from aserve import LLM, SamplingParams
    from aserve.core.kv_cache_manager import cdiv

    path, bs, new_tokens = gb.dummy_model_dir(root, "gemma3-12b"), 16, 64
    max_len = context + new_tokens + bs
    layer_block = 2 * bs * KV_HEADS * HEAD_DIM * 2  # bytes of one layer's K and V block (bf16)
    one_table_request = cdiv(max_len, bs) * 48 * layer_block  # a full-length request, every layer's blocks held
    kv_gb = 2 * one_table_request / 2**30
    llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=max_len, max_num_seqs=batch,
              enable_prefix_caching=False, kv_cache_memory_gb=kv_gb)  # fmt: skip
    core = llm.engine.core
    layout = core.runner.kv_layout
    per_request = sum(cdiv(max_len, bs) if w is None else cdiv(w, bs) + 1 for w in layout.group_windows)
    gb.record("memory_layout", f"{layout.num_groups} groups of {layout.num_slots} layers",
              note=f"windows {layout.group_windows}")  # fmt: skip
    gb.record(f"memory_requests_ctx{context}_one_table", 2, "requests",
              f"(a {kv_gb:.2f} GiB cache: {cdiv(max_len, bs)} blocks of 48 layers each)")  # fmt: skip
    gb.record(f"memory_requests_ctx{context}_hybrid", round(core.num_kv_blocks / per_request, 2), "requests",
              f"({core.num_kv_blocks} blocks of {layout.num_slots} layers; a request holds {per_request} at "
              "full length)")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 100000, (context,), generator=gen).tolist()}
               for _ in range(batch)]  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    assert {len(o.outputs[0].token_ids) for o in outs} == {new_tokens}
    gb.record(f"memory_served_b{batch}_ctx{context}", core.scheduler.num_preemptions, "preemptions",
              f"({batch} requests of {context} + {new_tokens} tokens in {seconds:.1f} s)")  # fmt: skip
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--sections", default="ceilings,kernel,decode")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    root = tempfile.mkdtemp()
    run = {
        "ceilings": gb.ceilings,
        "kernel": lambda: kernel(args.context, batches),
        "decode": lambda: decode(args.context, batches, root),
        "memory": lambda: memory(args.context, max(batches), root),
    }
    for name in args.sections.split(","):
        gb.run_section(name, run[name])
    gb.write_results(args.out)


if __name__ == "__main__":
    main()
