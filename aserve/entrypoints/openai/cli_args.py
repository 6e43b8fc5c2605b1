"""`aserve serve`'s server options (the engine's own are EngineArgs fields: aserve/cli.py), with vLLM's flag names,
and what they make of the app: the chat template, the reply role, CORS, the log levels.

Some of vLLM's server flags name things aserve does in one way only; they are accepted where their value is the way
aserve works and refused otherwise (never taken and ignored): --disable-log-requests (requests are logged only with
--enable-log-requests), --disable-uvicorn-access-log (no access log),
--structured-outputs-config / --guided-decoding-backend naming xgrammar (the only backend). vLLM's engine flags of
that kind are EngineArgs fields (aserve/fixed_engine_args.py)."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import os

from aserve.engine.llm_engine import DEFAULT_MAX_PENDING_CHARS, DEFAULT_POOL_SIZE
from aserve.entrypoints.openai.connections import bad_http_in_one_line
from aserve.entrypoints.openai.cors import CorsOptions
from aserve.entrypoints.openai.protocol import TEMPLATE_CONTROLS
from aserve.entrypoints.openai.reasoning import REASONING_PARSERS
from aserve.entrypoints.openai.request_fields import STRUCTURED_OUTPUT_BACKENDS
from aserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, load_plugin

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_frontend_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument("--api-key", nargs="+", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes, one of these keys (default: "
                            "$VLLM_API_KEY if set, else none)")  # fmt: skip
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
    serve.add_argument("--tool-call-parser", default=None,
                       help="the model's tool-call format: hermes (Hermes, Qwen 2.5 / 3), llama3_json (Llama 3.x), "
                            "mistral, pythonic / llama4_pythonic (Llama 3.2 / 4), qwen3_coder / qwen3_xml "
                            "(Qwen3-Coder), phi4_mini_json (Phi-4-mini), or one a --tool-parser-plugin file "
                            "defines (default: none)")  # fmt: skip
    serve.add_argument("--tool-parser-plugin", default=None,
                       help="a Python file of one's own tool-call parsers, subclasses of aserve.entrypoints.openai."
                            "tool_parsers.ToolParser, registered under their names for --tool-call-parser")  # fmt: skip
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
                            "cache; default: off, the field is absent)")  # fmt: skip
    serve.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info (the tokenizer's class, special tokens and chat template, for "
                            "clients that tokenise through /tokenize; default: off, 404)")  # fmt: skip
    serve.add_argument("--chat-template", default=None,
                       help="the chat template: a Jinja file, or the template itself (default: the "
                            "tokenizer's)")  # fmt: skip
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="chat requests may bring their own chat_template (default: off, such requests get "
                            "400)")  # fmt: skip
    serve.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                       help='chat template arguments for every request, a JSON object (e.g. {"enable_thinking": '
                            "false}); a request's chat_template_kwargs override them")  # fmt: skip
    serve.add_argument("--response-role", default="assistant", help="the role of chat completion replies")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="chat replies' thinking (up to </think>) as reasoning (and reasoning_content) apart "
                            "from content: deepseek_r1 (replies start in their reasoning), qwen3 (where they start "
                            "with <think>), mistral (Magistral's [THINK]...[/THINK])")  # fmt: skip
    serve.add_argument("--allowed-origins", type=_json_list, default=["*"],
                       help='CORS: origins browsers may call from, a JSON list (default: ["*"])')  # fmt: skip
    serve.add_argument("--allowed-methods", type=_json_list, default=["*"],
                       help='CORS: allowed methods, a JSON list (default: ["*"])')  # fmt: skip
    serve.add_argument("--allowed-headers", type=_json_list, default=["*"],
                       help='CORS: allowed request headers, a JSON list (default: ["*"])')  # fmt: skip
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic log line of throughput, running / waiting requests and KV use")  # fmt: skip
    serve.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info",
                       help="the HTTP server's own loggers' level (aiohttp's; vLLM's name)")  # fmt: skip
    serve.add_argument("--log-config-file", default=os.environ.get("VLLM_LOGGING_CONFIG_PATH") or None,
                       help="a logging configuration file, JSON in Python's logging.config.dictConfig schema, applied "
                            "over the defaults to aserve's and the HTTP server's loggers (default: "
                            "$VLLM_LOGGING_CONFIG_PATH, else none)")  # fmt: skip
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's id, prompt length and sampling parameters")  # fmt: skip
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="accepted: requests are logged only with --enable-log-requests")  # fmt: skip
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with a usage chunk, asked for (stream_options.include_usage) or "
                            "not")  # fmt: skip
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name tokens 'token_id:N' unless a request sets return_tokens_as_token_ids "
                            "false")  # fmt: skip
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="streamed chunks carry at least this many tokens (the first and last excepted): fewer "
                            "events per stream; a request's stream_interval may raise it")  # fmt: skip
    serve.add_argument("--enable-request-id-headers", action="store_true",
                       help="responses carry X-Request-Id: the request's header, else the id in the response "
                            "body")  # fmt: skip
    serve.add_argument("--disable-fastapi-docs", action="store_true",
                       help="no GET /openapi.json (vLLM's name for turning its API docs off)")  # fmt: skip
    serve.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="accepted: aserve writes no access log")  # fmt: skip
    serve.add_argument("--max-log-len", type=int, default=None,
                       help="the most characters of an output's text that --enable-log-outputs logs (default: all; "
                            "--enable-log-requests logs prompt lengths and parameters, never prompt text)")  # fmt: skip
    serve.add_argument("--structured-outputs-config", type=json_object, default=None,
                       help='accepted as {"backend": "xgrammar"} or "auto": structured output always uses '
                            "xgrammar")  # fmt: skip
    serve.add_argument("--guided-decoding-backend", default=None,
                       help="accepted as xgrammar or auto (vLLM's earlier flag)")  # fmt: skip


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, e.g. ["*"]')
    return parsed


def json_value(value: str):
    """A flag's JSON value of any type (vLLM's --compilation-config takes 3 or {"level": 3})."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def json_object(value: str) -> dict:
    parsed = json_value(value)
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def api_keys(ns: argparse.Namespace) -> list[str] | None:
    """--api-key's keys, else $VLLM_API_KEY's (vLLM's variable), else None: no key needed."""
    keys = ns.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else None)
    if keys is not None and not all(keys):
        raise ValueError("--api-key: a key may not be empty")
    return keys


def check_frontend_args(ns: argparse.Namespace) -> None:
    """ValueError for a value aserve cannot honour (the module docstring), or out of range."""
    if not 1 <= ns.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {ns.port}")
    if ns.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"--log-level must be debug, info, warning, error or critical, got {ns.log_level!r}")
    if ns.tokenizer_pool_size < 1 or ns.max_pending_prompt_chars < 1:
        raise ValueError("--tokenizer-pool-size and --max-pending-prompt-chars must be >= 1")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if ns.tool_parser_plugin is not None:
        load_plugin(ns.tool_parser_plugin)
    if ns.tool_call_parser is not None and ns.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {ns.tool_call_parser}: not a tool-call parser here (one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}, or one a --tool-parser-plugin file defines)")  # fmt: skip
    outputs = dict(ns.structured_outputs_config or {})
    if set(outputs) - {"backend"} or outputs.get("backend", "auto") not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(f"--structured-outputs-config {json.dumps(outputs)}: structured output always uses xgrammar "
                         'with its defaults ({"backend": "xgrammar"} or "auto" only)')  # fmt: skip
    if ns.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {ns.stream_interval}")
    if ns.guided_decoding_backend not in (None, *STRUCTURED_OUTPUT_BACKENDS):
        raise ValueError(f"--guided-decoding-backend {ns.guided_decoding_backend}: structured output always uses "
                         "xgrammar")  # fmt: skip
    reserved = sorted(set(ns.default_chat_template_kwargs or ()) & TEMPLATE_CONTROLS)
    if reserved:
        raise ValueError(f"--default-chat-template-kwargs may not set {reserved[0]!r} (requests set it)")
    if ns.chat_template is not None:  # read now, before minutes of loading
        ns.chat_template = load_chat_template(ns.chat_template)
    if ns.log_config_file is not None:
        ns.log_config = load_log_config(ns.log_config_file)


def load_log_config(path: str) -> dict:
    """--log-config-file's JSON object (dictConfig's schema: a "version" key); ValueError naming the flag."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--log-config-file {path}: {e}") from None
    if not isinstance(config, dict) or "version" not in config:
        raise ValueError(f'--log-config-file {path}: not a logging configuration (a JSON object with a "version")')
    return config


def cors_options(ns: argparse.Namespace) -> CorsOptions:
    return CorsOptions(tuple(ns.allowed_origins), tuple(ns.allowed_methods), tuple(ns.allowed_headers),
                       ns.allow_credentials)  # fmt: skip


def load_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the value itself where it names no file (vLLM's rule)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{%"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def set_log_levels(ns: argparse.Namespace) -> None:
    """The HTTP server's loggers at --uvicorn-log-level, then --log-config-file's configuration over everything."""
    level = "DEBUG" if ns.uvicorn_log_level == "trace" else ns.uvicorn_log_level.upper()
    logging.getLogger("aiohttp").setLevel(level)
    logging.getLogger("aiohttp.server").addFilter(bad_http_in_one_line)
    if getattr(ns, "log_config", None) is not None:
        try:
            logging.config.dictConfig(ns.log_config)
        except (ValueError, TypeError, AttributeError, ImportError) as e:
            raise ValueError(f"--log-config-file {ns.log_config_file}: {e}") from None
