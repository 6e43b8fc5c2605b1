"""`aserve serve`: the OpenAI-compatible server. Every engine argument is a flag with vLLM's name."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import time

from aiohttp import web

from aserve.core.metrics import PeriodicLogger
from aserve.engine.async_engine import AsyncEngine
from aserve.entrypoints.bench import add_bench_parser, run_bench
from aserve.entrypoints.cli_client import add_client_parsers, run_client
from aserve.entrypoints.config_file import add_config_arg, expand_config
from aserve.entrypoints.engine_cli_args import HelpWithDefaults, add_engine_args, engine_args_from
from aserve.entrypoints.openai.cli_args import (
    add_frontend_args,
    api_keys,
    check_frontend_args,
    cors_options,
    set_log_levels,
)
from aserve.entrypoints.openai.connections import ConnectionGuard, ConnectionLimits, listen_socket, start_listening
from aserve.entrypoints.openai.run_batch import add_run_batch_args, run_batch
from aserve.entrypoints.openai.serve_options import ServeOptions, add_serve_option_args
from aserve.entrypoints.openai.server import SERVER_OPTIONS, STATE_KEY, build_app
from aserve.entrypoints.openai.shutdown import begin_drain, drain
from aserve.quantize.quantize import add_quantize_parser, run_quantize
from aserve.version import __version__

try:
    import uvloop
except ImportError:  # e.g. Windows: the plain asyncio loop
    uvloop = None

logger = logging.getLogger("aserve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aserve", description="aserve: an OpenAI-compatible LLM server")
    parser.add_argument("-v", "--version", action="version", version=__version__)  # the number alone, as vLLM
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    add_frontend_args(serve)
    add_serve_option_args(serve)
    add_engine_args(serve)
    add_config_arg(serve)
    batch = sub.add_parser("run-batch", help="answer a file of OpenAI requests (vLLM's batch format) with a model")
    add_run_batch_args(batch)
    add_engine_args(batch)
    add_config_arg(batch)
    add_quantize_parser(sub)
    add_client_parsers(sub)
    add_bench_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = HelpWithDefaults
    return parser


def serve(ns: argparse.Namespace) -> None:
    args = engine_args_from(ns)
    if ns.model_tag is not None:
        args.model = ns.model_tag
    args.validate()  # a value aserve refuses fails now, before the port is taken
    limits = ConnectionLimits(ns.timeout_headers, ns.timeout_body, ns.timeout_keep_alive, ns.limit_concurrency)
    limits.validate()
    check_frontend_args(ns)
    options = ServeOptions.from_args(ns)
    keys = api_keys(ns)
    set_log_levels(ns)
    sock = listen_socket(ns.host, ns.port)  # before minutes of loading: a port in use is an error at once
    t0 = time.perf_counter()
    print(f"aserve: loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...", flush=True)
    engine = AsyncEngine.from_engine_args(
        args, tokenizer_pool_size=ns.tokenizer_pool_size, max_pending_prompt_chars=ns.max_pending_prompt_chars
    )
    config = engine.config
    if ns.chat_template is not None:  # (read by check_frontend_args)
        config.tokenizer.chat_template = ns.chat_template
    print(
        f"aserve: loaded {config.served_model_name} ({engine.num_params / 1e6:.1f}M params, "
        f"{str(config.dtype).removeprefix('torch.')}, {config.device}) in {time.perf_counter() - t0:.1f} s; "
        f"KV cache capacity {engine.kv_capacity_tokens} tokens; max_model_len {config.max_model_len}",
        flush=True,
    )
    run = uvloop.run if uvloop is not None else asyncio.run
    api = {"tool_call_parser": ns.tool_call_parser, "enable_auto_tool_choice": ns.enable_auto_tool_choice,
           "enable_prompt_tokens_details": ns.enable_prompt_tokens_details,
           "enable_tokenizer_info_endpoint": ns.enable_tokenizer_info_endpoint, "response_role": ns.response_role,
           "reasoning_parser": ns.reasoning_parser, "log_requests": ns.enable_log_requests,
           "cors_options": cors_options(ns), "trust_request_chat_template": ns.trust_request_chat_template,
           "default_chat_template_kwargs": ns.default_chat_template_kwargs,
           "force_include_usage": ns.enable_force_include_usage,
           "return_tokens_as_token_ids": ns.return_tokens_as_token_ids,
           "request_id_headers": ns.enable_request_id_headers, "openapi": not ns.disable_fastapi_docs,
           "stream_interval": ns.stream_interval}  # fmt: skip
    names = ns.served_model_name or [config.served_model_name]
    serving = _serve(engine, names, ns.host, ns.port, keys, ns.shutdown_timeout, limits, api,
                     log_stats=not ns.disable_log_stats, sock=sock, options=options)  # fmt: skip
    code = run(serving)
    if code:
        sys.exit(code)


async def _serve(
    engine,
    served_model_name: str | list[str],
    host: str,
    port: int,
    api_key: str | list[str] | None,
    shutdown_timeout: float = 30.0,
    limits: ConnectionLimits | None = None,
    api: dict | None = None,
    log_stats: bool = True,
    sock: socket.socket | None = None,
    options: ServeOptions | None = None,
) -> int:
    """api: build_app's keyword arguments (tool calling, usage details, /tokenizer_info, the reply role, CORS);
    options: TLS, the root path, the chat content format, GET /load.
    -> the exit status: 0 after a signal, 1 when the engine stopped by itself (its step loop failed: a dead
    tensor-parallel worker, ...)."""
    app = build_app(engine, served_model_name, api_key, **(api or {}))
    options = options or ServeOptions()
    options.setup_app(app)
    sock = sock or listen_socket(host, port)
    if log_stats:
        engine.stats.add_listener(PeriodicLogger(logger.info))
    # drain() ends every request before cleanup; the runner's own timeout only backs up handlers stuck writing to a
    # client that stopped reading.
    runner = web.AppRunner(app, **SERVER_OPTIONS, **options.parser_limits, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    options.setup_server(runner.server)
    # Every connection goes through the guard (read timeouts, connection limit) in front of aiohttp's protocol.
    guard = ConnectionGuard(runner.server, limits or ConnectionLimits())
    app[STATE_KEY].attach_connections(guard)
    tls = options.ssl_context
    listener = await start_listening(guard.protocol_factory, sock, tls, guard.limits.timeout_headers if tls else None)
    logger.info("connections: at most %d open; timeouts: headers %g s, body %g s, keep-alive %g s", guard.limit,
                guard.limits.timeout_headers, guard.limits.timeout_body, guard.limits.timeout_keep_alive)  # fmt: skip
    name = served_model_name if isinstance(served_model_name, str) else served_model_name[0]
    print(f"aserve: serving {name} at {options.scheme}://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
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


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def dashed(argv: list[str]) -> list[str]:
    """vLLM's flag spellings with underscores (--max_model_len 512, --max_model_len=512) as flags with dashes."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = dashed(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(argv, subcommands(parser))
    except ValueError as e:  # the YAML file missing, malformed, or naming no flag of the command
        print(f"aserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, getattr(ns, "log_level", "info").upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if ns.command == "serve":
        try:
            serve(ns)
        except ValueError as e:  # bad model path, impossible KV budget, ...
            print(f"aserve: error: {e}", file=sys.stderr)
            sys.exit(2)
    elif ns.command in ("chat", "complete"):
        try:
            run_client(ns)
        except ValueError as e:  # the server unreachable, or an error answer
            print(f"aserve: error: {e}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)
    elif ns.command == "run-batch":
        try:
            run_batch(ns, engine_args_from(ns))
        except ValueError as e:  # a URL, a missing input, a refused engine argument
            print(f"aserve: error: {e}", file=sys.stderr)
            sys.exit(2)
    elif ns.command == "bench":
        run_bench(ns)
    elif ns.command == "quantize":
        try:
            run_quantize(ns)
        except ValueError as e:  # bad model, group size that does not divide the layers, ...
            print(f"aserve: error: {e}", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    main()
