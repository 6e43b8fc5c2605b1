"""`aserve bench serve`: vLLM's `vllm bench serve` against a running OpenAI-compatible server (aserve, vLLM, ...).
The requests go out through loadgen's runner and client (streamed, every chunk timestamped, arrivals a gamma process
of --request-rate and --burstiness, --max-concurrency in flight); the result is vLLM's block and JSON
(serve_result.py), with the server's speculative decoding over the run where it verified drafts (spec_decode.py).
The API key, where the server wants one, is read from $OPENAI_API_KEY, as vLLM's client does."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import sys
import time

import aiohttp
import numpy as np
from tqdm import tqdm

from aserve.entrypoints.bench.errors import BenchmarkError
from aserve.entrypoints.bench.serve_args import (
    CHAT,
    COMPLETIONS,
    goodput_bounds,
    key_values,
    metric_percentiles,
    percentile_metrics,
)
from aserve.entrypoints.bench.serve_dataset import check_serve_dataset, serve_requests
from aserve.entrypoints.bench.serve_result import ServeSettings, detailed_fields, serve_result
from aserve.entrypoints.bench.server_tokenizer import ServerTokenizer
from aserve.entrypoints.bench.spec_decode import spec_decode_fields, spec_decode_lines
from loadgen.bench import LoadgenError, discover_model
from loadgen.client import Target, auth_headers, stream_request
from loadgen.config import Load, base_url
from loadgen.records import RequestRecord
from loadgen.runner import Bounds, Runner
from loadgen.server_metrics import MetricsScraper
from loadgen.workloads import RequestSpec, Session

_TIMEOUT = 6 * 60 * 60.0  # seconds a request may take, and may stay silent (queued behind others): vLLM's
_ARRIVAL_STREAM = 1  # the arrival gaps' random stream, apart from the prompts'


def run_serve(ns: argparse.Namespace) -> dict:
    """Runs the benchmark, prints vLLM's block, saves the results if asked; -> the result's fields."""
    _apply_general_lengths(ns)
    settings = ServeSettings(
        ns.request_rate,
        ns.max_concurrency,
        goodput_bounds(ns.goodput),
        percentile_metrics(ns.percentile_metrics),
        metric_percentiles(ns.metric_percentiles),
    )
    metadata = key_values(ns.metadata, "--metadata", "=")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if ns.num_prompts < 1 or not ns.request_rate > 0 or not ns.burstiness > 0:
        raise ValueError("--num-prompts must be >= 1, --request-rate and --burstiness > 0")
    check_serve_dataset(ns)
    endpoint = _endpoint(ns)
    url = base_url(ns.base_url or f"http://{_host(ns.host)}:{ns.port}")
    try:
        model_id, records, spec_fields = asyncio.run(_benchmark(ns, url, endpoint))
    except LoadgenError as e:
        raise BenchmarkError(str(e)) from None
    failed = [r for r in records if not r.ok]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, record in enumerate(failed[:10]):
            print(f"Error {i}: {record.error}")
    lines, fields = serve_result(records, settings)
    lines[-1:-1] = spec_decode_lines(spec_fields)  # before the closing rule, as vLLM prints it
    print("\n".join(lines), flush=True)
    now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    label = ns.label or ns.backend
    result = {
        "date": now,
        "endpoint_type": ns.backend,
        "backend": ns.backend,
        "label": ns.label,
        "model_id": model_id,
        "tokenizer_id": ns.tokenizer or model_id,
        "num_prompts": ns.num_prompts,
        **metadata,
        "request_rate": "inf" if math.isinf(ns.request_rate) else ns.request_rate,
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        **fields,
        **spec_fields,
    }
    if ns.save_detailed:
        result.update(detailed_fields(records))
    if ns.save_result or ns.append_result:
        path = _result_path(ns, label, model_id, now)
        with open(path, "a+" if ns.append_result else "w", encoding="utf-8") as f:
            if ns.append_result and f.tell() != 0:
                f.write("\n")
            json.dump(result, f)
        print(f"results: {path}", file=sys.stderr)
    if not any(r.ok for r in records):
        raise BenchmarkError(f"no request succeeded, e.g.: {failed[0].error}")
    return result


def _apply_general_lengths(ns: argparse.Namespace) -> None:
    """vLLM's --input-len / --output-len: the dataset-specific lengths they stand for."""
    if ns.input_len is not None:
        ns.random_input_len = ns.input_len
    if ns.output_len is not None:
        ns.random_output_len = ns.custom_output_len = ns.output_len
        ns.sharegpt_output_len = ns.prefix_repetition_output_len = ns.output_len


def _endpoint(ns: argparse.Namespace) -> str:
    """loadgen's endpoint (completions or chat) for --backend and --endpoint."""
    wanted = CHAT if ns.backend == "openai-chat" else COMPLETIONS
    if ns.endpoint is not None and ns.endpoint != wanted:
        other = "openai-chat" if ns.endpoint == CHAT else "openai"
        raise ValueError(f"--backend {ns.backend} sends {wanted} requests, not {ns.endpoint}: use --backend {other}")
    return "chat" if wanted == CHAT else "completions"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def _benchmark(ns: argparse.Namespace, url: str, endpoint: str) -> tuple[str, list[RequestRecord], dict]:
    """-> (the model's id, the measured requests' records, the server's speculative decoding over them)."""
    api_key = os.environ.get("OPENAI_API_KEY")
    headers = auth_headers(api_key)
    connector = aiohttp.TCPConnector(limit=0)  # --max-concurrency, not the pool, bounds the requests in flight
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        model_id = ns.model
        if model_id is None:
            print("Model not specified, fetching first model from server...")
            model_id = await discover_model(http, url, headers)
            print(f"First model name: {model_id}")
        model_name = ns.served_model_name or model_id
        specs = await serve_requests(ns, ServerTokenizer(http, url, headers, model_name), chat=endpoint == "chat")
        target = Target(
            url=url,
            model=model_name,
            endpoint=endpoint,
            api_key=api_key,
            temperature=ns.temperature,
            ignore_eos=ns.ignore_eos or ns.dataset_name == "random",
            extra_body=_extra_body(ns, endpoint),
        )
        await _ready_check(http, target, specs[0], ns.ready_check_timeout_sec)
        runner_options = {"max_concurrency": ns.max_concurrency, "request_timeout": _TIMEOUT, "read_timeout": _TIMEOUT}
        if ns.num_warmups > 0:
            print(f"Warming up with {ns.num_warmups} requests...")
            warmup = Runner(http, target, **runner_options)
            first = itertools.repeat(Session([specs[0]]))
            await warmup.run(Load("rate", None), first, Bounds(ns.num_warmups, None), np.random.default_rng(0))
            print("Warmup run completed.")
        scraper = MetricsScraper(http, url, headers, model_name)
        metrics_before = await scraper.scrape()
        print("Starting main benchmark run...")
        print(f"Traffic request rate: {ns.request_rate}")
        kind = "Poisson process" if ns.burstiness == 1.0 else "Gamma distribution"
        print(f"Burstiness factor: {ns.burstiness} ({kind})")
        print(f"Maximum request concurrency: {ns.max_concurrency}", flush=True)
        bar = tqdm(total=len(specs), disable=ns.disable_tqdm, file=sys.stderr)
        runner = Runner(
            http, target, arrival="gamma", burstiness=ns.burstiness, on_done=lambda _: bar.update(1), **runner_options
        )
        rate = None if math.isinf(ns.request_rate) else ns.request_rate
        one_turn_each = (Session([spec]) for spec in specs)
        rng = np.random.default_rng([ns.seed, _ARRIVAL_STREAM])
        if ns.profile:
            await _profiler(http, url, headers, "start")
        try:
            records = await runner.run(Load("rate", rate), one_turn_each, Bounds(len(specs), None), rng)
        finally:
            bar.close()
        if ns.profile:
            await _profiler(http, url, headers, "stop")
        spec_fields = spec_decode_fields(metrics_before, await scraper.scrape())
    return model_id, records, spec_fields


async def _profiler(http: aiohttp.ClientSession, url: str, headers: dict, action: str) -> None:
    """--profile: POST /start_profile or /stop_profile at the server's root (vLLM's routes)."""
    print("Starting profiler..." if action == "start" else "Stopping profiler...", flush=True)
    async with http.post(f"{url}/{action}_profile", headers=headers) as resp:
        if resp.status != 200:
            detail = (await resp.text())[:300]
            raise BenchmarkError(f"POST {url}/{action}_profile answered {resp.status}: start the server with "
                                 f"--profiler-config to profile it ({detail})")  # fmt: skip
    print("Profiler started" if action == "start" else "Profiler stopped", flush=True)


def _extra_body(ns: argparse.Namespace, endpoint: str) -> dict:
    """vLLM's sampling flags and --logprobs as request fields, under --extra-body's."""
    body = {
        key: value
        for key, value in (
            ("top_p", ns.top_p),
            ("top_k", ns.top_k),
            ("min_p", ns.min_p),
            ("frequency_penalty", ns.frequency_penalty),
            ("presence_penalty", ns.presence_penalty),
            ("repetition_penalty", ns.repetition_penalty),
        )
        if value is not None
    }
    if ns.logprobs is not None:
        body.update(
            {"logprobs": True, "top_logprobs": ns.logprobs} if endpoint == "chat" else {"logprobs": ns.logprobs}
        )
    return {**body, **(ns.extra_body or {})}


async def _ready_check(http: aiohttp.ClientSession, target: Target, spec: RequestSpec, timeout: float) -> None:
    """vLLM's initial test run: the first prompt, retried for up to `timeout` seconds until it succeeds."""
    print("Starting initial single prompt test run...")
    if timeout <= 0:
        print("Skipping endpoint ready check.")
        return
    deadline = time.monotonic() + timeout
    while True:
        body = target.body(spec.prompt, spec.max_tokens)
        outcome = await stream_request(http, target, body, _TIMEOUT, _TIMEOUT)
        if outcome.ok:
            print("Initial test run completed.")
            return
        if time.monotonic() >= deadline:
            raise BenchmarkError(
                f"Initial test run failed - Please make sure benchmark arguments are correctly "
                f"specified. Error: {outcome.error}"
            )
        await asyncio.sleep(1.0)


def _result_path(ns: argparse.Namespace, label: str, model_id: str, now: str) -> str:
    """vLLM's file name: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json, in --result-dir."""
    concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
    name = ns.result_filename or f"{label}-{ns.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{now}.json"
    if ns.result_dir:
        os.makedirs(ns.result_dir, exist_ok=True)
        name = os.path.join(ns.result_dir, name)
    return name
