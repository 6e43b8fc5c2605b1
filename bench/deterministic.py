"""The cost of deterministic mode: offline throughput and batch-1 decode, normal vs --deterministic, in one run.

    python bench/deterministic.py                                   # CPU: the embedded SmolLM2, small workload
    python bench/deterministic.py --num-requests 8 --input-len 32 --output-len 16 --decode-tokens 32   # quicker
    python bench/deterministic.py --arch llama3-8b --num-requests 256 --input-len 512 --output-len 256 \\
        --decode-tokens 256                                         # GPU: Llama-3-8B shape, random weights

offline     --num-requests random-token prompts of --input-len, --output-len tokens each (EOS ignored, greedy):
            output tokens per second of one generate() call
decode      one request, --decode-input-len prompt tokens: (time of --decode-tokens tokens - time of 1) /
            (--decode-tokens - 1), ms per token

--arch builds a config of that shape (bench/gpu_bench.py's ARCHS) and loads random weights (--load-format dummy);
without it, --model (default: the embedded model). On CPU both engines stay loaded and the measurements alternate
between them --rounds times, keeping each one's best (a shared CPU is noisy: compare the two columns of one run, not
runs); on a GPU the engines run one after the other. Also checks that the deterministic engine gives the same tokens
for the offline workload run alone and beside the decode request's prompt. Prints a table; --json appends the results
as a JSON line to a file. --kernels (GPU): also each mode's batch-1 decode step by kernel (the one-token CUDA graph's
replay under torch.profiler: us per step and launches per step; ASERVE_PDL=0 for each kernel's own time rather than
one that includes its wait for the kernel before), and every kernel of a batch-1 generate per output token (with
what runs outside the graph: the final norm, lm_head and sampling).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    hi = min(vocab, 40000)
    return [{"prompt_token_ids": [rng.randrange(100, hi) for _ in range(length)]} for _ in range(num)]


class Engine:
    """One LLM and its measurements."""

    def __init__(self, args, model: str | None, deterministic: bool) -> None:
        from aserve import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        kw = dict(dtype=args.dtype, seed=0, deterministic=deterministic, load_format=args.load_format)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_gb"):
            if getattr(args, name) is not None:
                kw[name] = getattr(args, name)
        self.llm = LLM(model, **kw)
        vocab = self.llm.engine.config.vocab_size
        self.prompts = make_prompts(args.num_requests, args.input_len, vocab, 1)
        self.decode_prompt = make_prompts(1, args.decode_input_len, vocab, 2)
        self.args = args
        self.llm.generate(make_prompts(2, 16, vocab, 3), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    def _generate(self, prompts, max_tokens: int):
        params = self.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.llm.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

    def offline(self) -> float:
        """Output tokens per second."""
        seconds, _ = self._generate(self.prompts, self.args.output_len)
        return self.args.num_requests * self.args.output_len / seconds

    def decode(self) -> float:
        """Batch-1 ms per token after the first."""
        one, _ = self._generate(self.decode_prompt, 1)
        many, _ = self._generate(self.decode_prompt, self.args.decode_tokens)
        return (many - one) / (self.args.decode_tokens - 1) * 1e3

    def step_kernels(self) -> tuple[float, list]:
        """(ms of one replay of the batch-1 decode CUDA graph, its kernel_times)."""
        from gpu_bench import bench_ms
        from kernel_profile import kernel_times

        graph = self.llm.engine.core.runner.graphs.graphs[(1, 1)][0]
        return bench_ms(graph.replay), kernel_times(graph.replay)

    def token_kernels(self) -> list:
        """kernel_times of a batch-1 generate of --decode-tokens tokens, per output token: the decode graph's kernels
        and what runs outside it (the final norm, lm_head, sampling), the prompt's forward spread over the tokens."""
        from kernel_profile import kernel_times

        n = self.args.decode_tokens
        return [(name, us / n, count / n) for name, us, count in
                kernel_times(lambda: self._generate(self.decode_prompt, n), calls=2)]  # fmt: skip

    def invariant(self) -> bool:
        """The offline workload's tokens: the same alone and with the decode prompt in the batch."""
        n = self.args.output_len
        _, alone = self._generate(self.prompts, n)
        _, beside = self._generate(self.decode_prompt + self.prompts, n)
        return alone == beside[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded model)")
    p.add_argument("--arch", default=None, help="a shape from bench/gpu_bench.py's ARCHS, random weights")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--decode-input-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="CPU: measurements alternate this many times")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--json", default=None, help="append the results as a JSON line to this file")
    p.add_argument("--kernels", action="store_true", help="GPU: each mode's batch-1 decode step by kernel")
    p.add_argument("--matmul", default=None, help="GPU: deterministic mode's matmul configuration, a name of "
                   "aserve/kernels/batch_invariant_matmul.py's CANDIDATES (default: its DEFAULT)")  # fmt: skip
    args = p.parse_args()
    if args.matmul is not None:
        from aserve.kernels import batch_invariant_matmul

        assert args.matmul in batch_invariant_matmul.CANDIDATES, args.matmul
        batch_invariant_matmul.DEFAULT = args.matmul

    model = args.model
    tmp = None
    if args.arch is not None:
        from gpu_bench import dummy_model_dir

        tmp = tempfile.TemporaryDirectory()
        model = dummy_model_dir(tmp.name, args.arch)
        args.load_format = "dummy"
        args.max_model_len = args.max_model_len or args.input_len + args.output_len + args.decode_tokens + 64
    on_gpu = torch.cuda.is_available()
    results = {mode: {"offline": 0.0, "decode": float("inf")} for mode in ("normal", "deterministic")}
    invariant = None
    kernels: dict[str, tuple] = {}  # mode -> (graph replay ms, kernel_times rows)
    if on_gpu:  # one engine at a time: each takes most of the GPU's memory
        for mode in results:
            engine = Engine(args, model, mode == "deterministic")
            results[mode]["offline"] = max(engine.offline() for _ in range(max(args.rounds - 1, 1)))
            results[mode]["decode"] = min(engine.decode() for _ in range(max(args.rounds - 1, 1)))
            if mode == "deterministic":
                invariant = engine.invariant()
            if args.kernels:
                kernels[mode] = (*engine.step_kernels(), engine.token_kernels())
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    else:  # both loaded; measurements alternate, each mode's best kept
        engines = {mode: Engine(args, model, mode == "deterministic") for mode in results}
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                results[mode]["offline"] = max(results[mode]["offline"], engine.offline())
                results[mode]["decode"] = min(results[mode]["decode"], engine.decode())
        invariant = engines["deterministic"].invariant()
    base = results["normal"]
    device = torch.cuda.get_device_name() if on_gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{args.arch or model or 'embedded model'} on {device}: {args.num_requests} x {args.input_len} in / "
          f"{args.output_len} out; decode {args.decode_input_len} in / {args.decode_tokens} out\n")  # fmt: skip
    print("| mode | offline output tok/s | vs normal | batch-1 decode ms/token | vs normal |\n|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['offline']:.1f} | {r['offline'] / base['offline']:.3f} | {r['decode']:.3f} | "
              f"{r['decode'] / base['decode']:.3f} |")  # fmt: skip
    print(f"\ndeterministic: offline tokens alone == beside another request: {invariant}")
    for mode, (replay_ms, rows, token_rows) in kernels.items():
        print(f"\n{mode}: one replay of the batch-1 decode graph {replay_ms:.3f} ms; by kernel (us a step, launches):")
        for name, us, count in rows[:16]:
            print(f"  {us:8.1f}  x{count:<6g} {name[:100]}")
        total = sum(us for _, us, _ in token_rows)
        print(f"{mode}: a batch-1 generate's kernels per output token, {total:.1f} us in all (us, launches):")
        for name, us, count in token_rows[:24]:
            print(f"  {us:8.1f}  x{count:<6.3g} {name[:100]}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"args": vars(args), "device": device, "results": results, "invariant": invariant,
                                "kernels": kernels}) + "\n")  # fmt: skip
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
