"""`aserve serve`: the OpenAI-compatible server. Every engine argument is a flag with vLLM's name."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import time
import typing

from aiohttp import web

from aserve.config import EngineArgs
from aserve.core.metrics import PeriodicLogger
from aserve.engine.async_engine import AsyncEngine
from aserve.engine.llm_engine import DEFAULT_MAX_PENDING_CHARS, DEFAULT_POOL_SIZE
from aserve.entrypoints.openai.connections import ConnectionGuard, ConnectionLimits
from aserve.entrypoints.openai.server import STATE_KEY, begin_drain, build_app, drain
from aserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from aserve.quantize.quantize import add_quantize_parser, run_quantize
from aserve.version import __version__

try:
    import uvloop
except ImportError:  # e.g. Windows: the plain asyncio loop
    uvloop = None

logger = logging.getLogger("aserve")

_HELP = {
    "model": "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "auto | bfloat16 | float16 | float32",
    "load_format": "auto | dummy (random weights at the model's real shapes)",
    "kv_cache_memory_gb": "KV cache budget in GiB (CPU default: 2)",
    "device": "auto | cpu | cuda",
    "enforce_eager": "CPU: do not torch.compile element-wise ops (faster start)",
    "debug_invariants": "check KV-block and queue invariants after every step (slow)",
    "max_queue_len": "serving: answer 429 (with Retry-After) when more sequences than this would wait for a slot",
    "async_scheduling": "prepare step N+1 while the GPU runs step N (default: on for CUDA)",
    "deterministic": "bitwise-reproducible tokens and logprobs per request whatever else is batched with it, "
    "however its prompt is chunked, with or without a prefix-cache hit, preemption or speculation (batch-invariant "
    "kernels; seeded sampling keyed by output position)",
    "kv_cache_dtype": "auto (the model's dtype) | fp8 / fp8_e4m3: KV cache in FP8 e4m3, twice the tokens in the same "
    "memory (per-layer k/v scales from the checkpoint, else 1.0)",
    "long_prefill_token_threshold": "at most this many of a prompt's tokens per step (0: what the token budget "
    "leaves): a long prompt joining running decodes lengthens their steps, and so their inter-token latency, less",
    "tensor_parallel_size": "split the model across this many GPUs (processes on CPU), Megatron-style; also -tp",
    "quantization": "awq / gptq / compressed-tensors / fp8: require a checkpoint so quantised (detected from the "
    "checkpoint either way); fp8 / int8 on a 16-bit checkpoint: quantise its linear weights at load to FP8 e4m3 / int8 "
    "(per channel)",
    "quantize_lm_head": "round the lm_head at load: int8 per channel (unquantised / int8 models), fp8 per channel "
    "(--quantization fp8, FP8 checkpoints), int4 per group (AWQ / GPTQ); a tied embedding keeps its 16-bit table",
}


_ALIASES = {"tensor_parallel_size": ("-tp",)}  # vLLM's short flags


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field: --max-num-seqs, --enable-prefix-caching/--no-enable-prefix-caching, ..."""
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        help_text = _HELP.get(f.name, "") + f" (default: {f.default})"
        if hint is bool or hint == bool | None:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        parser.add_argument(flag, *_ALIASES.get(f.name, ()), type=base, default=f.default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it ("default: ...")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help or not action.option_strings or action.default is argparse.SUPPRESS:
            return help
        if isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif action.default is None:
            default = "none"
        else:
            default = "%(default)s"
        return f"{help} (default: {default})" if help else f"default: {default}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aserve", description="aserve: an OpenAI-compatible LLM server")
    parser.add_argument("--version", action="version", version=f"aserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--log-level", default="info", help="debug, info, warning or error")
    serve.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they are ended (default: 30)",
    )  # fmt: skip
    serve.add_argument(
        "--timeout-headers",
        type=float,
        default=30.0,
        help="seconds a request's headers may take to arrive (then 408 and close; default: 30)",
    )
    serve.add_argument(
        "--timeout-body",
        type=float,
        default=60.0,
        help="seconds a request body may go without new data (then 408 and close; default: 60)",
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection stays open (default: 5)",
    )
    serve.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="most open client connections; more get 503 (default: the open-files limit, raised to "
        "its hard maximum, less 256)",
    )
    serve.add_argument(
        "--tokenizer-pool-size",
        type=int,
        default=DEFAULT_POOL_SIZE,
        help=f"threads that tokenise long prompts and render chats (default: {DEFAULT_POOL_SIZE})",
    )
    serve.add_argument("--max-pending-prompt-chars", type=int, default=DEFAULT_MAX_PENDING_CHARS,
                       help="characters of prompt text that may be tokenising at once; more get 429 "
                            f"(default: {DEFAULT_MAX_PENDING_CHARS})")  # fmt: skip
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="parse tool calls from the output when a chat request's tool_choice is 'auto' (the default "
                            "with tools); needs --tool-call-parser (default: off, such requests get 400)")  # fmt: skip
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="the model's tool-call format: hermes (Hermes, Qwen 2.5 / 3), llama3_json (Llama 3.x), "
                            "mistral (default: none)")  # fmt: skip
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
                            "cache; default: off, the field is absent)")  # fmt: skip
    serve.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info (the tokenizer's class, special tokens and chat template, for "
                            "clients that tokenise through /tokenize; default: off, 404)")  # fmt: skip
    add_engine_args(serve)
    add_quantize_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = HelpWithDefaults
    return parser


def serve(ns: argparse.Namespace) -> None:
    args = engine_args_from(ns)
    if ns.model_tag is not None:
        args.model = ns.model_tag
    limits = ConnectionLimits(ns.timeout_headers, ns.timeout_body, ns.timeout_keep_alive, ns.limit_concurrency)
    limits.validate()
    if ns.tokenizer_pool_size < 1 or ns.max_pending_prompt_chars < 1:
        raise ValueError("--tokenizer-pool-size and --max-pending-prompt-chars must be >= 1")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    t0 = time.perf_counter()
    print(f"aserve: loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...", flush=True)
    engine = AsyncEngine.from_engine_args(
        args, tokenizer_pool_size=ns.tokenizer_pool_size, max_pending_prompt_chars=ns.max_pending_prompt_chars
    )
    config = engine.config
    print(
        f"aserve: loaded {config.served_model_name} ({engine.num_params / 1e6:.1f}M params, "
        f"{str(config.dtype).removeprefix('torch.')}, {config.device}) in {time.perf_counter() - t0:.1f} s; "
        f"KV cache capacity {engine.kv_capacity_tokens} tokens; max_model_len {config.max_model_len}",
        flush=True,
    )
    run = uvloop.run if uvloop is not None else asyncio.run
    api = {"tool_call_parser": ns.tool_call_parser, "enable_auto_tool_choice": ns.enable_auto_tool_choice,
           "enable_prompt_tokens_details": ns.enable_prompt_tokens_details,
           "enable_tokenizer_info_endpoint": ns.enable_tokenizer_info_endpoint}  # fmt: skip
    serving = _serve(engine, config.served_model_name, ns.host, ns.port, ns.api_key, ns.shutdown_timeout, limits, api)
    code = run(serving)
    if code:
        sys.exit(code)


async def _serve(
    engine,
    served_model_name: str,
    host: str,
    port: int,
    api_key: str | None,
    shutdown_timeout: float = 30.0,
    limits: ConnectionLimits | None = None,
    api: dict | None = None,
) -> int:
    """api: build_app's tool_call_parser, enable_auto_tool_choice, enable_prompt_tokens_details and
    enable_tokenizer_info_endpoint. -> the exit
    status: 0 after a signal, 1 when the engine stopped by itself (its step loop failed: a dead tensor-parallel
    worker, ...)."""
    app = build_app(engine, served_model_name, api_key, **(api or {}))
    engine.stats.add_listener(PeriodicLogger(logger.info))
    # drain() ends every request before cleanup; the runner's own timeout only backs up handlers stuck writing to a
    # client that stopped reading.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    # Every connection goes through the guard (read timeouts, connection limit) in front of aiohttp's protocol.
    guard = ConnectionGuard(runner.server, limits or ConnectionLimits())
    app[STATE_KEY].attach_connections(guard)
    listener = await asyncio.get_running_loop().create_server(guard.protocol_factory, host, port, reuse_address=True)
    logger.info("connections: at most %d open; timeouts: headers %g s, body %g s, keep-alive %g s", guard.limit,
                guard.limits.timeout_headers, guard.limits.timeout_body, guard.limits.timeout_keep_alive)  # fmt: skip
    print(f"aserve: serving {served_model_name} at http://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first signal drains, a second one stops waiting
        if stop.is_set():
            force.set()
        else:
            begin_drain(app)  # at once, not when _serve next runs: a request arriving meanwhile already gets 503
            stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except NotImplementedError:
            pass
    stopped, failed = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine.wait_failed())
    await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if failed.done():  # nothing left to drain for: the engine's requests have ended with its error
        print(f"aserve: error: the engine stopped: {failed.result()}", file=sys.stderr, flush=True)
        force.set()
        code = 1
    stopped.cancel()
    failed.cancel()
    print(f"aserve: shutting down (in-flight requests get up to {shutdown_timeout:g} s)", flush=True)
    await drain(app, shutdown_timeout, force)
    listener.close()
    await runner.cleanup()
    print("aserve: stopped", flush=True)
    return code


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, ns.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if ns.command == "serve":
        try:
            serve(ns)
        except ValueError as e:  # bad model path, impossible KV budget, ...
            print(f"aserve: error: {e}", file=sys.stderr)
            sys.exit(2)
    elif ns.command == "quantize":
        try:
            run_quantize(ns)
        except ValueError as e:  # bad model, group size that does not divide the layers, ...
            print(f"aserve: error: {e}", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    main()
