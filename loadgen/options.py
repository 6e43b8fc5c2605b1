"""Command-line flags of `loadgen [run]` and their translation into a RunConfig."""

from __future__ import annotations

import argparse
import json
import math

from loadgen.config import SLO, RunConfig

_SLO_KEYS = {
    "ttft_ms": "ttft_ms",
    "ttft": "ttft_ms",
    "tpot_ms": "tpot_ms",
    "tpot": "tpot_ms",
    "e2e_ms": "e2e_ms",
    "e2e": "e2e_ms",
}


def parse_slo(text: str) -> SLO:
    """'ttft_ms=500,tpot_ms=50' (also e2e_ms; the _ms may be left out) -> SLO."""
    bounds = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in _SLO_KEYS:
            raise ValueError(f"bad --slo part {part!r}: use ttft_ms=..., tpot_ms=..., e2e_ms=... (milliseconds)")
        try:
            bounds[_SLO_KEYS[key.strip()]] = float(value)
        except ValueError:
            raise ValueError(f"bad --slo value in {part!r}: not a number") from None
    if not bounds:
        raise ValueError("--slo needs at least one bound, e.g. ttft_ms=500,tpot_ms=50")
    return SLO(**bounds)


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """'rate=1,2,4,8' or 'concurrency=1,4,16' -> (param, values)."""
    param, sep, values = text.partition("=")
    param = param.strip()
    if not sep or param not in ("rate", "concurrency"):
        raise ValueError(f"bad --sweep {text!r}: use rate=1,2,4 or concurrency=1,4,16")
    try:
        numbers = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"bad --sweep values in {text!r}: not numbers") from None
    if not numbers or any(not v > 0 for v in numbers):
        raise ValueError(f"--sweep values must be > 0, got {values!r}")
    if param == "concurrency" and any(math.isinf(v) or v != int(v) for v in numbers):
        raise ValueError("--sweep concurrency values must be whole numbers")
    return param, numbers


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already explains it, or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default" in (action.help or "") or action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser(prog: str = "loadgen") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Load-test an OpenAI-compatible server. Also: `loadgen compare A.json B.json`, "
        "`loadgen report RUN.json --html R.html`.",
        formatter_class=_HelpFormatter,
    )
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (…/v1 is accepted too)")
    t.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    t.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions",
    )
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=("random", "shared-prefix", "chat", "grounded", "file"),
        default="random",
        help="what the requests look like (docs/loadgen.md)",
    )
    w.add_argument(
        "--input-len",
        default="256",
        help="prompt tokens (shared-prefix: the unique suffix; chat: each user turn; grounded: the "
        "passage): N, LO:HI (uniform) or lognormal:MEDIAN:SIGMA",
    )
    w.add_argument("--output-len", default=None, help="max_tokens, same forms (default 128; grounded: passage + 25%%)")
    w.add_argument(
        "--prompt-format",
        choices=("text", "ids"),
        default="text",
        help="text: words (sized with the server's /tokenize); ids: random token ids (completions only)",
    )
    w.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn from [0, N)")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: K shared system prompts")
    w.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: P tokens each")
    w.add_argument("--num-turns", type=int, default=3, help="chat: user turns per conversation")
    w.add_argument("--dataset", default=None, help='file: JSONL lines {"prompt": ..., "max_tokens": N}')
    w.add_argument("--seed", type=int, default=0, help="the same seed sends the same requests")
    r = p.add_argument_group("requests")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    r.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask for exactly max_tokens (vLLM extension; default: on for random and shared-prefix)",
    )
    r.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    a = p.add_argument_group("load")
    a.add_argument("--rate", type=float, default=None, help="requests/s, open loop (default: all at once)")
    a.add_argument(
        "--arrival",
        choices=("poisson", "gamma", "constant"),
        default=None,
        help="inter-arrival times (default poisson; gamma when --burstiness is given)",
    )
    a.add_argument("--burstiness", type=float, default=None, help="gamma shape: 1 = Poisson, <1 burstier")
    a.add_argument("--concurrency", type=int, default=None, help="closed loop: N users, each waits for its reply")
    a.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests (open loop)")
    a.add_argument("--num-requests", type=int, default=None, help="measured requests (default 100 w/o --duration)")
    a.add_argument("--duration", type=float, default=None, help="seconds; no request starts after it")
    a.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    a.add_argument("--sweep", default=None, help="rate=1,2,4,8 or concurrency=1,4,16: one run per value")
    o = p.add_argument_group("objectives")
    o.add_argument("--slo", default=None, help="per-request bounds, e.g. ttft_ms=500,tpot_ms=50[,e2e_ms=...]")
    o.add_argument(
        "--slo-attainment",
        type=float,
        default=0.9,
        help="a load level meets the SLO when this fraction of its requests does",
    )
    c = p.add_argument_group("client and output")
    c.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    c.add_argument("--read-timeout", type=float, default=120.0, help="seconds of silence before giving up")
    c.add_argument("--no-metrics", action="store_true", help="do not scrape the server's /metrics")
    c.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics polls")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--out", default=None, help="write results (summary + per-request records) to FILE.json")
    c.add_argument("--html", default=None, help="write the HTML report here (default: next to --out)")
    c.add_argument("--plots-dir", default=None, help="also write the PNG plots into this directory")
    return p


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    """Raises ValueError with a message naming the flag to fix."""
    extra_body = {}
    if ns.extra_body:
        try:
            extra_body = json.loads(ns.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not valid JSON: {e}") from None
        if not isinstance(extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
    sweep_param, sweep_values = parse_sweep(ns.sweep) if ns.sweep else (None, [])
    if sweep_param is not None and getattr(ns, sweep_param) is not None:
        raise ValueError(f"--sweep {sweep_param}=... replaces --{sweep_param}; give only one")
    if sweep_param == "rate" and ns.concurrency is not None:
        raise ValueError("--sweep rate=... is open loop; drop --concurrency (or sweep concurrency)")
    if sweep_param == "concurrency" and ns.rate is not None:
        raise ValueError("--sweep concurrency=... is closed loop; drop --rate")
    arrival = ns.arrival or ("gamma" if ns.burstiness is not None else "poisson")
    return RunConfig(
        url=ns.url,
        model=ns.model,
        endpoint=ns.endpoint,
        api_key=ns.api_key,
        workload=ns.workload,
        input_len=ns.input_len,
        output_len=ns.output_len,
        prompt_format=ns.prompt_format,
        vocab_size=ns.vocab_size,
        num_prefixes=ns.num_prefixes,
        prefix_len=ns.prefix_len,
        num_turns=ns.num_turns,
        dataset=ns.dataset,
        seed=ns.seed,
        temperature=ns.temperature,
        ignore_eos=ns.ignore_eos,
        extra_body=extra_body,
        arrival=arrival,
        rate=ns.rate,
        burstiness=1.0 if ns.burstiness is None else ns.burstiness,
        concurrency=ns.concurrency,
        max_concurrency=ns.max_concurrency,
        num_requests=ns.num_requests,
        duration=ns.duration,
        warmup=ns.warmup,
        slo=parse_slo(ns.slo) if ns.slo else None,
        slo_attainment=ns.slo_attainment,
        sweep_param=sweep_param,
        sweep_values=sweep_values,
        request_timeout=ns.request_timeout,
        read_timeout=ns.read_timeout,
        scrape_metrics=not ns.no_metrics,
        metrics_interval=ns.metrics_interval,
        progress=not ns.no_progress,
    )
