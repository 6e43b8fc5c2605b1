"""`aserve bench serve`'s flags: vLLM's `vllm bench serve` names and defaults. Flags for what aserve's benchmark does
not do are refused by name (aserve/entrypoints/bench/refused.py)."""

from __future__ import annotations

import argparse
import json

from aserve.entrypoints.bench.datasets import add_synthetic_dataset_args
from aserve.entrypoints.bench.refused import add_refused_args

BACKENDS = ("openai", "openai-chat", "vllm")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# vLLM's dataset names; those aserve reads are SERVE_DATASETS, the others are refused with the reason
DATASET_NAMES = (
    "sharegpt",
    "burstgpt",
    "sonnet",
    "random",
    "random-mm",
    "random-rerank",
    "hf",
    "custom",
    "prefix_repetition",
    "spec_bench",
    "txt-slices",
)
SERVE_DATASETS = ("random", "custom", "sharegpt", "prefix_repetition")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")

_NOT_HERE = "aserve's benchmark does not implement it"
REFUSED = {
    "--lora-modules": "aserve serves no LoRA adapters",
    "--lora-assignment": "aserve serves no LoRA adapters",
    "--ramp-up-strategy": _NOT_HERE + " (sweep rates with `loadgen --sweep rate=...`)",
    "--ramp-up-start-rps": _NOT_HERE + " (sweep rates with `loadgen --sweep rate=...`)",
    "--ramp-up-end-rps": _NOT_HERE + " (sweep rates with `loadgen --sweep rate=...`)",
    "--self-timed": "it replays the timed_trace dataset, which aserve does not read",
    "--no-self-timed": "it replays the timed_trace dataset, which aserve does not read",
    "--probe-request-rate": _NOT_HERE,
    "--plot-timeline": _NOT_HERE + " (`loadgen report RUN.json --html` draws request timelines)",
    "--timeline-itl-thresholds": _NOT_HERE,
    "--plot-dataset-stats": _NOT_HERE,
    "--header": _NOT_HERE + " (the API key is read from $OPENAI_API_KEY)",
    "--insecure": _NOT_HERE + " (TLS certificates are always checked)",
    "--use-beam-search": _NOT_HERE,
    "--skip-tokenizer-init": "token counts come from the server",
    "--chat-template-kwargs": _NOT_HERE + " (put chat_template_kwargs in --extra-body)",
    "--random-batch-size": "it batches prompts for embedding models; aserve serves generative models",
    "--no-reranker": "aserve serves generative models only",
    "--random-mm-base-items-per-request": "prompts are text only",
    "--random-mm-num-mm-items-range-ratio": "prompts are text only",
    "--random-mm-limit-mm-per-prompt": "prompts are text only",
    "--random-mm-bucket-config": "prompts are text only",
    "--hf-subset": "aserve reads no Hugging Face datasets",
    "--hf-split": "aserve reads no Hugging Face datasets",
    "--hf-name": "aserve reads no Hugging Face datasets",
    "--hf-output-len": "aserve reads no Hugging Face datasets",
    "--sonnet-input-len": "aserve does not read the sonnet dataset",
    "--sonnet-output-len": "aserve does not read the sonnet dataset",
    "--sonnet-prefix-len": "aserve does not read the sonnet dataset",
    "--spec-bench-output-len": "aserve does not read the spec_bench dataset",
    "--spec-bench-category": "aserve does not read the spec_bench dataset",
    "--blazedit-min-distance": "aserve does not read the blazedit dataset",
    "--blazedit-max-distance": "aserve does not read the blazedit dataset",
}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("server")
    t.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="openai / vllm: /v1/completions requests; openai-chat: /v1/chat/completions",
    )
    t.add_argument("--base-url", default=None, help="the server's URL, e.g. http://host:8000 (default: --host/--port)")
    t.add_argument("--host", default="127.0.0.1", help="the server's host")
    t.add_argument("--port", type=int, default=8000, help="the server's port")
    t.add_argument(
        "--endpoint",
        choices=(COMPLETIONS, CHAT),
        default=None,
        help=f"the API path (default: {COMPLETIONS}; {CHAT} for --backend openai-chat)",
    )
    t.add_argument("--model", default=None, help="the model to ask for (default: the server's first model)")
    t.add_argument("--served-model-name", default=None, help="the name requests give (default: --model)")
    t.add_argument("--label", default=None, help="the results' label and file-name prefix (default: --backend)")
    t.add_argument(
        "--tokenizer",
        default=None,
        help="accepted for vLLM's command lines: prompts are made and counted with the server's "
        "tokenizer (/tokenize, /detokenize, usage)",
    )
    t.add_argument("--tokenizer-mode", default="auto", help="accepted for vLLM's command lines (as --tokenizer)")
    t.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM's command lines (no code runs)")
    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset-name",
        choices=DATASET_NAMES,
        default="random",
        help=f"the prompts: {', '.join(SERVE_DATASETS)} (the others are refused)",
    )
    d.add_argument(
        "--dataset-path",
        default=None,
        help='custom: a JSONL file of {"prompt": ...} lines; sharegpt: the ShareGPT JSON file',
    )
    d.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    d.add_argument("--seed", type=int, default=0, help="the same seed sends the same prompts and arrival times")
    d.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    d.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="sets every dataset's output length (--random-output-len, --custom-output-len, ...)",
    )
    d.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    d.add_argument("--random-output-len", type=int, default=128, help="random: output tokens (max_tokens)")
    add_synthetic_dataset_args(d, "--random-prefix-len")
    d.add_argument("--custom-output-len", type=int, default=256, help="custom: output tokens per request")
    d.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="custom on /v1/completions: send the prompt as it is, not rendered by the chat template",
    )
    d.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: output tokens per request (default: the conversation's reply length)",
    )
    d.add_argument(
        "--no-oversample",
        action="store_true",
        help="custom, sharegpt: send only the file's usable entries when they are fewer than "
        "--num-prompts (else some are repeated)",
    )
    d.add_argument("--disable-shuffle", action="store_true", help="custom, sharegpt: keep the file's order")
    d.add_argument("--no-stream", action="store_true", help="accepted for vLLM's command lines (files are read whole)")
    r = p.add_argument_group("load")
    r.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (inf: all at once), arrivals a gamma process (see --burstiness)",
    )
    r.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="the gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 steadier",
    )
    r.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    r.add_argument("--num-warmups", type=int, default=0, help="requests (the first prompt) sent first, not measured")
    r.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=0,
        help="retry the first request this long until the server answers it (0: no check)",
    )
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    r.add_argument(
        "--profile",
        action="store_true",
        help="run the server's profiler over the measured requests (POST /start_profile, /stop_profile: a server "
        "started with --profiler-config)",
    )
    s = p.add_argument_group("sampling")
    s.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens tokens (always on for the random dataset)"
    )
    s.add_argument("--temperature", type=float, default=None, help="(default: not sent, the server's default)")
    for name, kind in (
        ("top-p", float),
        ("top-k", int),
        ("min-p", float),
        ("frequency-penalty", float),
        ("presence-penalty", float),
        ("repetition-penalty", float),
    ):
        s.add_argument(f"--{name}", type=kind, default=None, help="(default: not sent, the server's default)")
    s.add_argument("--logprobs", type=int, default=None, help="logprobs per token to ask for (default: none)")
    s.add_argument("--extra-body", type=_json_object, default=None, help="a JSON object merged into every request")
    o = p.add_argument_group("results")
    o.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help=f"the metrics to report percentiles of, from {','.join(PERCENTILE_METRICS)}",
    )
    o.add_argument("--metric-percentiles", default="99", help="the percentiles to report, e.g. 50,90,99")
    o.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:VALUE",
        help="requests meeting every bound count as good: ttft:MS tpot:MS e2el:MS",
    )
    o.add_argument("--save-result", action="store_true", help="write the results to a JSON file")
    o.add_argument("--append-result", action="store_true", help="append the results to the JSON file as a line")
    o.add_argument(
        "--save-detailed",
        action="store_true",
        help="the results file also lists every request's lengths, times, generated text and error",
    )
    o.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="fields added to the results")
    o.add_argument("--result-dir", default=None, help="the results file's directory (default: the current one)")
    o.add_argument(
        "--result-filename",
        default=None,
        help="the results file's name (default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)",
    )
    add_refused_args(p, REFUSED)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def key_values(items: list[str] | None, flag: str, sep: str) -> dict[str, str]:
    """['a=1', 'b=2'] -> {'a': '1', 'b': '2'}; a malformed item is an error naming the flag."""
    out = {}
    for item in items or ():
        key, found, value = item.partition(sep)
        if not found or not key.strip():
            raise ValueError(f"{flag} takes KEY{sep}VALUE items, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def goodput_bounds(items: list[str] | None) -> dict[str, float]:
    """--goodput ttft:500 tpot:50 -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    bounds = {}
    for key, value in key_values(items, "--goodput", ":").items():
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput: unknown metric {key!r}; use ttft, tpot or e2el")
        try:
            bounds[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}:{value}: not a number of milliseconds") from None
        if bounds[key] < 0:
            raise ValueError(f"--goodput {key}:{value}: must be >= 0")
    return bounds


def percentile_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)}; use {','.join(PERCENTILE_METRICS)}")
    return names


def metric_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: not numbers, e.g. 50,90,99") from None
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: percentiles are in [0, 100]")
    return values
