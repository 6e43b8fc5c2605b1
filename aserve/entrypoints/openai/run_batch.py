"""`aserve run-batch -i requests.jsonl -o results.jsonl [--model M ...]`: vLLM's OpenAI batch runner.

Each input line is one request of OpenAI's batch file format:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}

and each output line, in input order, its result in vLLM's shape:

    {"id": "aserve-<hex>", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "aserve-batch-<hex>", "body": {<the endpoint's answer>}},
     "error": null}

A request the endpoint refuses keeps its status code with `body` null and the error body (`{"error": {...}}`) under
`error`; a line that is not such a request (not JSON, no custom_id, another method or URL, a stream) gets status 400
and the reason as `error`. Nothing ends the run early.

The requests are answered by the server's own app (server.build_app), in this process, over a Unix socket in a
private temporary directory: the same parsing, sampling defaults, chat rendering and errors as `aserve serve`. Up to
2 x max_num_seqs requests are in flight at once (vLLM's bound), so the engine batches them."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import uuid

import aiohttp
from aiohttp import web

from aserve.config import EngineArgs
from aserve.core.metrics import PeriodicLogger
from aserve.engine.async_engine import AsyncEngine
from aserve.entrypoints.openai.connections import LISTEN_BACKLOG
from aserve.entrypoints.openai.server import SERVER_OPTIONS, build_app

logger = logging.getLogger("aserve")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True,
                        help="the requests, one JSON object a line (a local path)")  # fmt: skip
    parser.add_argument("-o", "--output-file", required=True,
                        help="where the results go, one JSON object a line in input order (a local path)")  # fmt: skip
    parser.add_argument("--response-role", default="assistant", help="the role of chat replies")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report usage.prompt_tokens_details.cached_tokens")  # fmt: skip
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="accepted: a batch answer always carries its usage")  # fmt: skip
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's id, prompt length and sampling parameters")  # fmt: skip
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="accepted: requests are logged without their prompt text")  # fmt: skip
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic log line of throughput and running / waiting requests")  # fmt: skip
    parser.add_argument("--enable-metrics", action="store_true",
                        help="refused: run-batch serves no Prometheus metrics (aserve serve does, on "
                             "/metrics)")  # fmt: skip


def check_run_batch_args(ns: argparse.Namespace) -> None:
    """ValueError before the model loads: URLs (vLLM reads and writes http(s) URLs; aserve has no network), a missing
    input, --enable-metrics."""
    for flag, path in (("--input-file", ns.input_file), ("--output-file", ns.output_file)):
        if "://" in path:
            raise ValueError(f"{flag} {path}: aserve run-batch reads and writes local files only (it makes no network "
                             "requests): fetch the input first, or upload the output afterwards")  # fmt: skip
    if not os.path.isfile(ns.input_file):
        raise ValueError(f"--input-file {ns.input_file}: no such file")
    if ns.enable_metrics:
        raise ValueError("--enable-metrics: aserve run-batch serves no Prometheus metrics (aserve serve does, on "
                         "/metrics)")  # fmt: skip


def run_batch(ns: argparse.Namespace, args: EngineArgs) -> int:
    """Runs the file; -> how many results are errors."""
    check_run_batch_args(ns)
    args.validate()
    with open(ns.output_file, "w", encoding="utf-8"):  # an unwritable output fails now, not after the batch
        pass
    engine = AsyncEngine.from_engine_args(args)
    # vLLM's batch files name the model as --model gave it: that name is taken too
    names = [args.served_model_name or engine.config.served_model_name]
    if args.served_model_name is None and args.model not in (None, names[0]):
        names.append(args.model)
    api = {"response_role": ns.response_role, "enable_prompt_tokens_details": ns.enable_prompt_tokens_details,
           "force_include_usage": ns.enable_force_include_usage, "log_requests": ns.enable_log_requests}  # fmt: skip
    if not ns.disable_log_stats:
        engine.stats.add_listener(PeriodicLogger(logger.info))
    app = build_app(engine, names, None, **api)
    return asyncio.run(_run(app, ns.input_file, ns.output_file, 2 * args.max_num_seqs))


async def _run(app: web.Application, input_file: str, output_file: str, max_in_flight: int) -> int:
    runner = web.AppRunner(app, **SERVER_OPTIONS, access_log=None)
    await runner.setup()
    with tempfile.TemporaryDirectory(prefix="aserve-batch-") as directory:  # mode 0700: this user's only
        path = os.path.join(directory, "api.sock")
        await web.UnixSite(runner, path, backlog=LISTEN_BACKLOG).start()  # max_in_flight connections at once
        connector = aiohttp.UnixConnector(path=path, limit=max_in_flight)
        session = aiohttp.ClientSession("http://localhost", connector=connector,
                                        timeout=aiohttp.ClientTimeout(total=None))  # fmt: skip
        try:
            errors = await _answer_all(session, input_file, output_file, max_in_flight)
        finally:
            await session.close()
            await runner.cleanup()  # the app's cleanup shuts the engine down
    return errors


async def _answer_all(session: aiohttp.ClientSession, input_file: str, output_file: str, max_in_flight: int) -> int:
    """Reads the input a line at a time, at most `max_in_flight` requests out; writes each result as soon as those
    before it are written."""
    slots = asyncio.Semaphore(max_in_flight)
    done: dict[int, dict] = {}
    written = errors = 0
    tasks = set()
    # the input is read as bytes: a line that is not UTF-8 is that line's error (_answer), not the run's end
    with open(input_file, "rb") as lines, open(output_file, "w", encoding="utf-8") as out:

        def flush() -> None:
            nonlocal written, errors
            while written in done:
                result = done.pop(written)
                errors += result["error"] is not None
                out.write(_json_line(result))
                written += 1

        async def answer(index: int, line: bytes) -> None:
            try:
                done[index] = await _answer(session, line)
            finally:
                slots.release()
            flush()

        index = 0
        for line in lines:
            if not line.strip():
                continue
            await slots.acquire()
            task = asyncio.create_task(answer(index, line))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
        await asyncio.gather(*tasks)
    logger.info("run-batch: %d requests, %d errors -> %s", written, errors, output_file)
    return errors


async def _answer(session: aiohttp.ClientSession, line: bytes) -> dict:
    request_id = f"aserve-batch-{uuid.uuid4().hex}"
    custom_id = None
    try:
        request = json.loads(line.decode("utf-8"))
        custom_id = request.get("custom_id") if isinstance(request, dict) else None
        problem = _not_a_request(request)
        body = json.dumps(request["body"]) if problem is None else ""  # encoded here: it nests as deep as it read
    except UnicodeDecodeError as e:
        problem = f"the line is not UTF-8 text: {e}"
    except json.JSONDecodeError as e:
        problem = f"the line is not JSON: {e}"
    except RecursionError:  # json's guard against deep nesting (Python's recursion limit, ~1,000 levels)
        problem = "the line is nested too deeply"
    if problem is not None:
        return _result(custom_id, request_id, 400, error=problem)
    try:
        async with session.post(request["url"], data=body, headers={"Content-Type": "application/json"}) as resp:
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, ValueError) as e:  # not expected of the app: the result says so, the run goes on
        return _result(custom_id, request_id, 500, error=f"the request failed: {e!r}")
    if resp.status != 200:
        return _result(custom_id, request_id, resp.status, error=body)
    return _result(custom_id, request_id, 200, body=body)


def _not_a_request(request) -> str | None:
    """Why a parsed line is not a batch request, or None."""
    if not isinstance(request, dict):
        return "each line must be a JSON object with custom_id, method, url and body"
    if not isinstance(request.get("custom_id"), str):
        return "custom_id must be a string"
    if request.get("method") != "POST":
        return f"method must be POST, got {request.get('method')!r}"
    if request.get("url") not in ENDPOINTS:
        return f"URL {request.get('url')} was used. Supported endpoints: {', '.join(ENDPOINTS)}"
    if not isinstance(request.get("body"), dict):
        return "body must be a JSON object (the endpoint's request)"
    if request["body"].get("stream"):
        return "Request must not be sent in stream mode"
    return None


def _json_line(result: dict) -> str:
    """A result as a line of UTF-8 JSON, its text unescaped; a lone surrogate (a custom_id read from a JSON escape
    such as \\ud800) has no UTF-8 form and is written escaped, as the input had it."""
    line = json.dumps(result, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(result)
    return line + "\n"


def _result(custom_id, request_id: str, status: int, body=None, error=None) -> dict:
    response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"aserve-{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
