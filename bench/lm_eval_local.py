"""lm-evaluation-harness against `aserve serve`: its `local-completions` model runs a small multiple-choice task
(bench/lm_eval_task: 20 questions in a JSONL read with `dataset_path: json`, no dataset hub) over HTTP, and each
choice's log-likelihood it got back is compared with the same tokens scored directly by transformers in float32.

    pip install 'lm-eval[api]'          # or pip install -e '.[lmeval]'; not needed by aserve or its tests
    python bench/lm_eval_local.py [--lm-eval lm_eval] [--url http://127.0.0.1:8000] [--num-concurrent 1]
                                  [--out DIR] [--limit N] [--no-reference] [--remote-tokenizer]

Without --url, the script starts `aserve serve` with the embedded default model (SmolLM2-135M-Instruct) on a free
port and stops it at the end. lm_eval is run as a user runs it (the command is printed): the server's model
directory is its local Hugging Face tokenizer (tokenizer_backend=huggingface, no hub), so every loglikelihood request
is a completion of token ids with echo, logprobs 1 and max_tokens 1, and lm-eval sums the continuation's prompt
logprobs. The data_files path in the task is relative to the repository root, where lm_eval runs. Prints lm-eval's
table, then the comparison with transformers: the largest difference of a choice's log-likelihood and the accuracy
the reference scores give.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aserve.models.model_path import resolve_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from aserve_server import start_server, stop_server  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join("bench", "lm_eval_task")
TASK = "aserve_mc"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def lm_eval_command(ns: argparse.Namespace, url: str, model: str, tokenizer_dir: str, out: str) -> list[str]:
    tokenizer = (
        "tokenizer_backend=remote"
        if ns.remote_tokenizer
        else f"tokenizer_backend=huggingface,tokenizer={tokenizer_dir}"
    )
    model_args = f"base_url={url}/v1/completions,model={model},{tokenizer},num_concurrent={ns.num_concurrent}"
    cmd = [*shlex.split(ns.lm_eval), "--model", "local-completions", "--model_args", model_args, "--tasks", TASK,
           "--include_path", TASK_DIR, "--output_path", out, "--log_samples"]  # fmt: skip
    return cmd + (["--limit", str(ns.limit)] if ns.limit else [])


def read_outputs(out: str) -> tuple[dict, list[dict]]:
    """lm-eval's output folder -> (the task's metrics, its samples)."""
    [results] = glob.glob(os.path.join(out, "*", "results_*.json"))
    [samples] = glob.glob(os.path.join(out, "*", f"samples_{TASK}_*.jsonl"))
    with open(results) as f:
        metrics = json.load(f)["results"][TASK]
    with open(samples) as f:
        return metrics, [json.loads(line) for line in f]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """As lm-eval encodes a (context, continuation) request for a causal model: trailing spaces of the context move to
    the continuation, the whole is encoded once and split at the context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    n_context = len(tokenizer(context, add_special_tokens=False).input_ids)
    return whole[:n_context], whole[n_context:]


def reference(tokenizer_dir: str, samples: list[dict]) -> tuple[float, float, int]:
    """Each sample's choices scored by transformers (float32) -> (largest |log-likelihood difference| from what
    lm-eval got from the server, the reference accuracy, questions where both pick the same choice)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(tokenizer_dir, dtype=torch.float32).eval()
    worst, correct, agree = 0.0, 0, 0
    for sample in samples:
        ours = []
        for args in sample["arguments"].values():
            context, continuation = encode_pair(tokenizer, args["arg_0"], args["arg_1"])
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            positions = range(len(context) - 1, len(context) + len(continuation) - 1)
            ours.append(sum(logprobs[p, ids[0, p + 1]].item() for p in positions))
        served = [float(ll) for ll, _ in sample["filtered_resps"]]
        worst = max(worst, *(abs(a - b) for a, b in zip(ours, served)))
        pick = max(range(len(ours)), key=ours.__getitem__)
        correct += pick == int(sample["target"])
        agree += pick == max(range(len(served)), key=served.__getitem__)
    return worst, correct / len(samples), agree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm-eval", default=shutil.which("lm_eval") or f"{sys.executable} -m lm_eval",
                   help="the lm_eval command (default: lm_eval on PATH)")  # fmt: skip
    p.add_argument("--url", help="a running server's base URL (default: start `aserve serve` with the default model)")
    p.add_argument("--tokenizer", help="the served model's directory (default: the embedded model's)")
    p.add_argument("--num-concurrent", type=int, default=1, help="lm-eval's concurrent requests")
    p.add_argument("--limit", type=int, help="only the first N questions")
    p.add_argument("--out", help="lm-eval's output folder (default: a temporary one)")
    p.add_argument("--no-reference", action="store_true", help="skip the comparison with transformers")
    p.add_argument("--remote-tokenizer", action="store_true",
                   help="lm-eval tokenises through the server (tokenizer_backend=remote: GET /tokenizer_info, "
                        "POST /tokenize and /detokenize; a server started here gets "
                        "--enable-tokenizer-info-endpoint)")  # fmt: skip
    ns = p.parse_args()

    tokenizer_dir = ns.tokenizer or resolve_model(None)[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = ns.out or os.path.join(tmp, "lm_eval")
        proc, url = (
            (None, ns.url)
            if ns.url
            else start_server(
                "--no-debug-invariants",
                "--kv-cache-memory-gb",
                "2",
                *(["--enable-tokenizer-info-endpoint"] if ns.remote_tokenizer else []),
                log_path=os.path.join(tmp, "server.log"),
                timeout=600,
            )
        )
        try:
            cmd = lm_eval_command(ns, url, served_model(url), tokenizer_dir, out)
            print("$", shlex.join(cmd), flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=REPO, env={**os.environ, **OFFLINE}, check=True)
            seconds = time.perf_counter() - t0
        finally:
            if proc is not None:
                stop_server(proc)
        metrics, samples = read_outputs(out)
    print(f"\nlm_eval: {len(samples)} questions in {seconds:.0f} s; acc {metrics['acc,none']:.2f}, "
          f"acc_norm {metrics['acc_norm,none']:.2f}")  # fmt: skip
    if not ns.no_reference:
        worst, acc, agree = reference(tokenizer_dir, samples)
        print(f"transformers float32 on the same tokens: acc {acc:.2f}; the same choice picked in {agree}/"
              f"{len(samples)} questions; largest log-likelihood difference {worst:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
