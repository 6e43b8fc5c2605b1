"""GPU offline throughput, repeated: 256 requests x 512 prompt / 256 output tokens (EOS ignored) on a
Llama-3-8B-shaped model with random weights, run --repeats times in one process (the first repeat includes
warm-up effects; host-side jitter shows in the spread).

    PYTHONPATH=. python bench/gpu_throughput_repeats.py [--repeats 4]
"""

import argparse
import sys
import tempfile
import time

import torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--repeats", type=int, default=4)
args = parser.parse_args()
sys.path.insert(0, "bench")
sys.path.insert(0, "tests")
import gpu_bench as gb  # noqa: E402

from aserve import LLM, SamplingParams  # noqa: E402

d = gb.dummy_model_dir(tempfile.mkdtemp(), gb.LLAMA3_8B)
llm = LLM(d, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256)
gen = torch.Generator().manual_seed(2)
prompts = [{"prompt_token_ids": torch.randint(100, 100000, (512,), generator=gen).tolist()} for _ in range(256)]
llm.generate(prompts[:16], SamplingParams(max_tokens=2, ignore_eos=True))
for i in range(args.repeats):
    llm.engine.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
    el = time.perf_counter() - t
    print(f"repeat {i}: full workload {el:.2f}s = {256*256/el:.0f} tok/s", flush=True)
