"""What one loadgen invocation does: the target, the workload, the arrivals, the bounds and the SLO."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

Endpoint = Literal["completions", "chat"]
WorkloadName = Literal["random", "shared-prefix", "chat", "grounded", "file"]
ArrivalKind = Literal["poisson", "gamma", "constant"]

# Synthetic workloads control output lengths by ignoring EOS; natural-text ones let the model stop (a grounded copy
# should end where the passage ends, a chat reply where the model says so).
_IGNORE_EOS_BY_DEFAULT = {"random": True, "shared-prefix": True, "chat": False, "grounded": False, "file": False}


class SLO(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request latency objectives in milliseconds; None = not constrained. A request meets the SLO when it
    succeeded and every given bound holds (TPOT is undefined, so not checked, for a one-token output)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def describe(self) -> str:
        parts = [f"{name}<={value:g}" for name, value in msgspec.structs.asdict(self).items() if value is not None]
        return ", ".join(parts) or "none"


class Load(msgspec.Struct, frozen=True):
    """One load level: open-loop arrivals at `value` requests/s (None = all at once), or `value` closed-loop users."""

    mode: Literal["rate", "concurrency"]
    value: float | None

    def describe(self) -> str:
        if self.mode == "rate":
            return "rate=inf" if self.value is None else f"rate={self.value:g}"
        return f"concurrency={self.value:g}"


class RunConfig(msgspec.Struct, kw_only=True):
    # target
    url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: Endpoint = "completions"
    api_key: str | None = None  # sent as a Bearer token; never written to results
    # workload
    workload: WorkloadName = "random"
    input_len: str = "256"  # a LengthDist spec: 256, 64:512, lognormal:256:0.5
    output_len: str | None = None  # None: 128 (grounded: long enough to copy the passage)
    prompt_format: Literal["text", "ids"] = "text"
    vocab_size: int = 32000  # token-id prompts draw from [0, vocab_size)
    num_prefixes: int = 4  # shared-prefix: K system prompts ...
    prefix_len: int = 512  # ... of P tokens each
    num_turns: int = 3  # chat: user turns per conversation
    dataset: str | None = None  # file: JSONL with "prompt" and optional "max_tokens"
    seed: int = 0
    # request options
    temperature: float = 0.0
    ignore_eos: bool | None = None  # None: on for random/shared-prefix, off otherwise
    extra_body: dict = msgspec.field(default_factory=dict)
    # arrivals and bounds
    arrival: ArrivalKind = "poisson"
    rate: float | None = None  # requests/s; None = all at once (unless concurrency is set)
    burstiness: float = 1.0  # gamma shape: <1 burstier than Poisson, >1 smoother
    concurrency: int | None = None  # closed loop: this many users, each sending as soon as its last reply ends
    max_concurrency: int | None = None  # cap on in-flight requests for open-loop arrivals
    num_requests: int | None = None  # measured requests (default 100 when no --duration)
    duration: float | None = None  # seconds: no request starts after this
    warmup: int = 0  # requests sent and discarded before measuring
    # objectives and sweeps
    slo: SLO | None = None
    slo_attainment: float = 0.9  # a load level meets the SLO when this fraction of requests does
    sweep_param: Literal["rate", "concurrency"] | None = None
    sweep_values: list[float] = msgspec.field(default_factory=list)
    # client behaviour
    request_timeout: float = 600.0  # seconds per request, from send to the end of the stream
    read_timeout: float = 120.0  # seconds without a byte from the server (keep-alive comments count)
    scrape_metrics: bool = True
    metrics_interval: float = 0.5  # seconds between /metrics polls (peak KV usage, running/waiting)
    progress: bool = True

    def __post_init__(self) -> None:
        self.url = base_url(self.url)
        if self.prompt_format == "ids" and self.endpoint == "chat":
            raise ValueError("token-id prompts (--prompt-format ids) need --endpoint completions")
        if self.workload == "file" and not self.dataset:
            raise ValueError("--workload file needs --dataset FILE.jsonl")
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give --rate (open loop) or --concurrency (closed loop), not both")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("--rate must be > 0 (omit it, or pass inf, to send everything at once)")
        if self.rate is not None and math.isinf(self.rate):
            self.rate = None
        if self.burstiness <= 0:
            raise ValueError("--burstiness must be > 0")
        for name in ("concurrency", "max_concurrency", "num_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("--duration must be > 0")
        if self.num_requests is None and self.duration is None:
            self.num_requests = 100
        unbounded_rate = (
            self.rate is None
            and self.concurrency is None
            and (self.sweep_param is None or (self.sweep_param == "rate" and any(map(math.isinf, self.sweep_values))))
        )
        if self.num_requests is None and unbounded_rate:
            raise ValueError("sending everything at once (no --rate) needs --num-requests, not just --duration")
        from loadgen.workloads.lengths import parse_length  # here: loadgen.workloads imports this module

        parse_length(self.input_len)  # fail now, with the flag's name, not mid-run
        if self.output_len is not None:
            parse_length(self.output_len)
        if self.sweep_param is not None and not self.sweep_values:
            raise ValueError("a sweep needs values, e.g. --sweep rate=1,2,4")
        if not 0 < self.slo_attainment <= 1:
            raise ValueError("--slo-attainment must be in (0, 1]")

    @property
    def effective_ignore_eos(self) -> bool:
        return _IGNORE_EOS_BY_DEFAULT[self.workload] if self.ignore_eos is None else self.ignore_eos

    def loads(self) -> list[Load]:
        """The load levels to run: the sweep's values, or the single --rate / --concurrency."""
        if self.sweep_param == "rate":
            return [Load("rate", None if math.isinf(v) else v) for v in self.sweep_values]
        if self.sweep_param == "concurrency":
            return [Load("concurrency", v) for v in self.sweep_values]
        if self.concurrency is not None:
            return [Load("concurrency", self.concurrency)]
        return [Load("rate", self.rate)]

    def public(self) -> dict:
        """The config as written to results: the API key masked, rate=inf as None."""
        out = msgspec.to_builtins(self)
        out["api_key"] = None if self.api_key is None else "***"
        out["sweep_values"] = [None if math.isinf(v) else v for v in self.sweep_values]  # JSON has no inf
        return out


def base_url(url: str) -> str:
    """http://host:port, whether the user wrote that, .../v1 or .../v1/."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    return url
