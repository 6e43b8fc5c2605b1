"""CPU decode attention per layer: aserve/kernels/cpu.py's paged_decode_attention (AVX512-BF16 path and generic C)
vs the torch path it replaces (block gather with index_select + SDPA: TorchAttentionBackend), SmolLM2 shapes
(9 query / 3 KV heads, head_dim 64, bf16), in one command:

    python bench/cpu_attention.py [--threads N] [--repeats 3] [--e2e] [--baseline REV] [--layers 30]

Cases: batch 64 x 300-token contexts (the throughput workload's decode steps) and batch 1 x 256.
--baseline REV adds the AVX512-BF16 kernel as it was at git revision REV (its source compiled beside the current
one), timed in the same alternating rounds, and prints the largest difference between the two outputs.
--layers N adds the engine's memory pattern: N layer caches of 64 requests x 320 tokens called in turn (30 x ~16 MB
of K/V, more than the L3 holds; the cases above repeat one layer, whose cache stays in cache), ms per call.
--e2e adds the engine with the kernel on and off (CPUAttentionBackend's decodes, and the one-token path, which
reads the cache with it, or gather + SDPA), alternating in one process
(this VM drifts by +-20 % between runs): bench/offline_throughput.py's two workloads, the embedded SmolLM2 in bf16 —
64 requests x 256 random prompt tokens / 128 output tokens (output tok/s), and batch 1 x 128 / 256 (decode ms per
token, the time to a first token subtracted). The torch path's
time includes its per-step prepare() and the cache write (as one layer of a step pays them; the kernel's own
backend call pays the write too, not timed here). Prints a markdown table: ms per layer, best of the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from attention_cases import random_batch  # noqa: E402

from aserve.kernels import cpu  # noqa: E402
from aserve.layers.attention.torch_backend import CPUAttentionBackend, TorchAttentionBackend  # noqa: E402

_TAKES_DECODE_KERNEL = CPUAttentionBackend.takes_decode_kernel


def use_decode_kernel(llm, on: bool, one_token) -> None:
    """The engine's decodes on the C kernel (and one-token steps on `one_token`, the model's one-token path), or
    gathered for SDPA."""
    CPUAttentionBackend.takes_decode_kernel = _TAKES_DECODE_KERNEL if on else (lambda self, short_max_q: False)
    llm.engine.core.runner.model.cpu_one_token = one_token if on else None


def e2e(repeats: int) -> None:
    import random

    from aserve import LLM, SamplingParams

    llm = LLM(None, dtype="bfloat16", max_model_len=1024)
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]} for _ in range(n)]

    def run(n: int, length: int, out: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts(n, length), SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    run(4, 64, 8)  # warm-up (compilation)
    one_token = llm.engine.core.runner.model.cpu_one_token
    results: dict[str, list[float]] = {}
    for _ in range(repeats):
        for on in (True, False):
            use_decode_kernel(llm, on, one_token)
            name = "kernel" if on else "gather + SDPA"
            results.setdefault(f"{name}: 64 x 256/128 output tok/s", []).append(64 * 128 / run(64, 256, 128))
            e2e_s, ttft_s = run(1, 128, 256), run(1, 128, 1)
            results.setdefault(f"{name}: batch 1 decode ms/token", []).append((e2e_s - ttft_s) / 255 * 1e3)
    use_decode_kernel(llm, True, one_token)
    print("\n| engine, workload | runs (alternating) | median |\n|---|---|---|")
    for key, values in results.items():
        print(f"| {key} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")


def baseline_kernel(rev: str):
    """The raw entry points of the CPU kernels at git revision `rev`: its aserve/kernels/csrc built as an extension
    (nothing registered), or, for revisions that held the C source in Python strings, that source compiled by its
    own aserve/kernels/cpu_build.py and loaded with ctypes."""
    import subprocess
    import tempfile
    import types

    from aserve.kernels import cpu_build

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True,
                              text=True).stdout  # fmt: skip

    tree = subprocess.run(["git", "ls-tree", "--name-only", rev, "aserve/kernels/csrc/"], cwd=root, check=True,
                          capture_output=True, text=True).stdout.split()  # fmt: skip
    if tree:
        csrc = tempfile.mkdtemp(prefix="aserve_csrc_")
        for path in tree:
            with open(os.path.join(csrc, os.path.basename(path)), "w") as f:
                f.write(show(path))
        return cpu_build.build(csrc)
    modules = {}
    for name in ("cpu_build", "cpu_attention"):
        module = modules[name] = types.ModuleType(f"{name}_{rev}")
        module.cpu_build = modules.get("cpu_build")
        text = show(f"aserve/kernels/{name}.py").replace("from aserve.kernels import cpu_build", "")
        exec(compile(text, f"{rev}:aserve/kernels/{name}.py", "exec"), module.__dict__)
    old = modules["cpu_attention"]
    return modules["cpu_build"].library(f"paged_decode_{rev}", old._SOURCE, old._SIGNATURES)


def raw_call(lib, q, kv, meta, out):
    """paged_decode_attention through a library's C entry point (bf16, the SIMD path; no window, no soft-capping)."""
    n, num_heads, head_dim = q.shape
    lib.paged_decode_attention(
        q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), meta.block_tables.data_ptr(), meta.seq_lens.data_ptr(),
        out.data_ptr(), n, num_heads, kv.shape[3], head_dim, kv.shape[2], meta.block_tables.stride(0), q.stride(0),
        out.stride(0), head_dim**-0.5, 1, torch.get_num_threads(), 0, 0, 0.0,
    )  # fmt: skip


def layers_case(args) -> None:
    """ms per call over args.layers layer caches in turn: the kernel now (and at --baseline), alternating."""
    batch, ctx = 64, 320
    caches = [random_batch([1] * batch, [ctx] * batch, 9, 3, 64, 16, batch * 22 + 4, torch.bfloat16)
              for _ in range(args.layers)]  # fmt: skip
    out = torch.empty_like(caches[0][0])
    fns = {"kernel now": lambda q, kv, meta: cpu.paged_decode_attention(
        q, kv[0], kv[1], meta.block_tables, meta.seq_lens, out)}  # fmt: skip
    if args.baseline:
        lib = baseline_kernel(args.baseline)
        fns[f"kernel at {args.baseline}"] = lambda q, kv, meta: raw_call(lib, q, kv, meta, out)
    times = {name: [] for name in fns}
    for _ in range(max(args.repeats, 3)):
        for name, fn in fns.items():
            for q, _k, _v, kv, meta in caches:
                fn(q, kv, meta)
            t0 = time.perf_counter()
            for _ in range(4):
                for q, _k, _v, kv, meta in caches:
                    fn(q, kv, meta)
            times[name].append((time.perf_counter() - t0) / (4 * args.layers) * 1e3)
    print(f"\n{args.layers} layer caches of {batch} x {ctx} in turn, ms per call (rounds; median):\n")
    for name, values in times.items():
        print(f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.median(values):.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--e2e", action="store_true")
    p.add_argument("--baseline", help="also time the kernel at this git revision")
    p.add_argument("--layers", type=int, default=1, help="> 1: also the N-layer-caches case")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu.available(), "no working C compiler"
    rows = []
    for batch, ctx in ((64, 300), (1, 256)):
        bs = 16
        q, k, v, kv, meta = random_batch([1] * batch, [ctx] * batch, 9, 3, 64, bs, batch * 20 + 4, torch.bfloat16)
        out = torch.empty_like(q)
        backend = TorchAttentionBackend()

        def torch_path():
            backend.prepare(meta, bs)
            backend.forward(q, k, v, kv, meta)

        def kernel(generic: bool):
            return lambda: cpu.paged_decode_attention(
                q, kv[0], kv[1], meta.block_tables, meta.seq_lens, out, generic=generic
            )

        fns = {"kernel (AVX512-BF16)": kernel(False), "kernel (generic C)": kernel(True), "gather + SDPA": torch_path}
        if args.baseline:
            lib, base_out = baseline_kernel(args.baseline), torch.empty_like(q)
            fns[f"kernel at {args.baseline}"] = lambda: raw_call(lib, q, kv, meta, base_out)
            fns["kernel (AVX512-BF16)"]()
            fns[f"kernel at {args.baseline}"]()
            diff = (out.float() - base_out.float()).abs().max().item()
            print(f"{batch} x {ctx}: max |kernel - kernel at {args.baseline}| = {diff:.3g}")
        calls = 30 if batch > 1 else 300
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.repeats):  # alternating, so drift hits every variant alike
            for name, fn in fns.items():
                fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e3)
        rows.append((f"{batch} x {ctx}", best))
    names = list(rows[0][1])
    if args.layers > 1:
        layers_case(args)
    if args.e2e:
        e2e(args.repeats)
    print(f"\nthreads: {args.threads}\n\n| batch x context | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for case, best in rows:
        print(f"| {case} | " + " | ".join(f"{best[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
