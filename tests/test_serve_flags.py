"""`aserve serve` with vLLM's server flags: a chat template from a file, several served names, the reply role, CORS
for browser clients; the flags aserve accepts as what it always does, and the values it refuses."""

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from aserve_server import running_server
from test_server import make_client

from aserve.cli import main as cli_main
from aserve.entrypoints.openai.cors import CorsOptions

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<bot>{% endif %}"
)


def call(url: str, path: str, body: dict | None = None, method: str | None = None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
            is_json = resp.headers.get("Content-Type", "").startswith("application/json")
            return resp.status, dict(resp.headers), json.loads(raw) if is_json else raw
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_vllm_server_flags(tiny_model, tmp_path, capsys):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    flags = ["--model", tiny_model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
             "--chat-template", str(template), "--served-model-name", "first", "second", "--response-role", "bot",
             "--disable-log-stats", "--disable-log-requests", "--trust-remote-code", "--swap-space", "4",
             "--enable-chunked-prefill", "--tokenizer-mode", "auto", "--uvicorn-log-level", "warning", "-pp", "1",
             "--api-key", "k"]  # fmt: skip
    with running_server(*flags) as url:
        auth = {"Authorization": "Bearer k"}
        status, _, models = call(url, "/v1/models", headers=auth)
        assert status == 200 and [m["id"] for m in models["data"]] == ["first", "second"]
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        _, _, tok = call(url, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
        assert tok["tokens"] == tokenizer.encode("<user>Hi\n<bot>", add_special_tokens=False)
        status, headers, chat = call(url, "/v1/chat/completions", {
            "model": "second", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}, headers={
            **auth, "Origin": "http://example.com"})  # fmt: skip
        assert status == 200 and chat["model"] == "first" and chat["choices"][0]["message"]["role"] == "bot"
        assert headers["Access-Control-Allow-Origin"] == "*"
        # a browser's preflight carries no API key
        status, headers, _ = call(url, "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        # vLLM's clients: aserve chat / complete against the server
        for command in ("chat", "complete"):
            cli_main([command, "--url", f"{url}/v1", "--api-key", "k", "--max-tokens", "3", "-q", "Hi"])
            printed = capsys.readouterr().out
            assert printed.endswith("\n") and len(printed) > 1
        with pytest.raises(SystemExit) as e:
            cli_main(["complete", "--url", f"{url}/v1", "-q", "Hi"])  # no API key
        assert e.value.code == 1 and "HTTP 401" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--no-enable-chunked-prefill"], "always chunks prompts"),
    (["--tokenizer-mode", "slow"], "tokenizer_mode='slow' (--tokenizer-mode)"),
    (["-pp", "2"], "tensor parallelism only"), (["--revision", "main"], "names a commit, branch or tag"),
    (["--chat-template", "no/such/file"], "neither a file nor a Jinja template"),
    (["--default-chat-template-kwargs", '{"tools": []}'], "may not set 'tools'"),
    (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
])  # fmt: skip
def test_values_aserve_cannot_honour_are_refused(flags, message, capsys, tiny_model):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--model", tiny_model, "--enforce-eager", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


async def test_request_chat_templates_and_default_kwargs(tiny_model):
    """--trust-request-chat-template lets a request bring its template (and documents to it);
    --default-chat-template-kwargs reach every template unless the request's chat_template_kwargs say otherwise."""
    from transformers import AutoTokenizer

    from aserve import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=128,
                                  served_model_name="tiny"))  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    template = "{{ greeting }}{% for d in documents or [] %} {{ d['text'] }}{% endfor %} {{ messages[-1]['content'] }}"
    client = await make_client(engine, trust_request_chat_template=True,
                               default_chat_template_kwargs={"greeting": "Hello"})  # fmt: skip
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": template, "max_tokens": 1,
                "return_token_ids": True}  # fmt: skip
        cases = (({}, "Hello Hi"), ({"chat_template_kwargs": {"greeting": "Bye"}}, "Bye Hi"),
                 ({"documents": [{"title": "a", "text": "doc"}]}, "Hello doc Hi"))  # fmt: skip
        for extra, rendered in cases:
            expected = tokenizer.encode(rendered, add_special_tokens=False)
            chat = await (await client.post("/v1/chat/completions", json={**body, **extra})).json()
            assert chat["prompt_token_ids"] == expected
            tok = await (await client.post("/tokenize", json={"messages": body["messages"], "chat_template": template,
                                                              **extra})).json()  # fmt: skip
            assert tok["tokens"] == expected
    finally:
        await client.close()


async def test_enable_log_requests(tiny_model, caplog):
    import logging

    from aserve import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=128,
                                  served_model_name="tiny"))  # fmt: skip
    for enabled in (False, True):
        client = await make_client(engine, log_requests=enabled)
        try:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="aserve"):
                resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                                                                  "temperature": 0.5})  # fmt: skip
                assert resp.status == 200
            logged = [r.getMessage() for r in caplog.records if "prompt tokens" in r.getMessage()]
            assert len(logged) == enabled and (not enabled or ("3 prompt tokens" in logged[0]
                                                               and "temperature=0.5" in logged[0]))  # fmt: skip
        finally:
            await client.close()


def test_log_config_file_configures_the_loggers(tiny_model, tmp_path, monkeypatch, capsys):
    """--log-config-file (or $VLLM_LOGGING_CONFIG_PATH): Python's dictConfig JSON over aserve's defaults; here the
    aserve logger's records go to a file in the config's own format, with --enable-log-requests' line among them.
    A file that is no such configuration fails at start-up, naming the flag."""
    log = tmp_path / "aserve.log"
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": "CONFIGURED %(name)s %(message)s"}},
              "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log), "formatter": "plain"}},
              "loggers": {"aserve": {"handlers": ["file"], "level": "INFO"}}}  # fmt: skip
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    with running_server("--model", tiny_model, "--enforce-eager", "--max-model-len", "256", "--enable-log-requests",
                        "--log-config-file", str(path)) as url:  # fmt: skip
        status, _, _ = call(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 200
    lines = log.read_text().splitlines()
    assert any(line.startswith("CONFIGURED aserve") and "3 prompt tokens" in line for line in lines)
    path.write_text(json.dumps({"handlers": {}}))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(path))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--model", tiny_model, "--enforce-eager"])
    assert exit_info.value.code == 2 and "--log-config-file" in capsys.readouterr().err
    # (in a process of its own: a configuration that fails has already closed the process's handlers)
    path.write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}}))
    argv = [sys.executable, "-m", "aserve", "serve", "--model", tiny_model, "--log-config-file", str(path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"--log-config-file {path}" in proc.stderr


async def test_cors_options(tiny_model):
    from aserve import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=128))
    client = await make_client(engine, cors_options=CorsOptions(("http://ok.example",), ("POST",), ("content-type",),
                                                                allow_credentials=True))  # fmt: skip
    try:
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        ok = await client.options("/v1/completions", headers={"Origin": "http://ok.example", **preflight})
        assert ok.status == 200 and ok.headers["Access-Control-Allow-Origin"] == "http://ok.example"
        assert ok.headers["Access-Control-Allow-Credentials"] == "true"
        for origin, extra in (("http://evil.example", {}), ("http://ok.example", {"Access-Control-Request-Method":
                                                                                    "DELETE"})):  # fmt: skip
            bad = await client.options("/v1/completions", headers={"Origin": origin, **preflight, **extra})
            assert bad.status == 400
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "stream": True}
        streamed = await client.post("/v1/completions", json=body, headers={"Origin": "http://ok.example"})
        assert streamed.headers["Access-Control-Allow-Origin"] == "http://ok.example"
        await streamed.read()
        other = await client.post("/v1/completions", json=body, headers={"Origin": "http://evil.example"})
        assert "Access-Control-Allow-Origin" not in other.headers
        await other.read()
    finally:
        await client.close()


def test_unparseable_http_is_one_warning_line():
    import logging
    import sys

    from aiohttp.http_exceptions import BadHttpMessage

    from aserve.entrypoints.openai.connections import bad_http_in_one_line

    try:
        raise BadHttpMessage("Invalid character in Content-Length:\n\n  b'Content-Length: abc'")
    except BadHttpMessage:
        record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                   ("127.0.0.1",), sys.exc_info())  # fmt: skip
    assert bad_http_in_one_line(record)
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert record.getMessage() == "Invalid HTTP request: Invalid character in Content-Length: b'Content-Length: abc'"


def test_vllms_api_server_module_starts_the_same_server():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "aserve.entrypoints.openai.api_server", "--help"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "usage: aserve serve" in out.stdout and "--reasoning-parser" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "aserve.entrypoints.openai.api_server", "--port", "0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "--port must be in 1..65535" in bad.stderr


def test_token_counts_take_vllms_suffixes():
    from aserve.cli import build_parser

    ns = build_parser().parse_args(["serve", "--max-model-len", "32k", "--max-num-batched-tokens", "8K"])
    assert (ns.max_model_len, ns.max_num_batched_tokens) == (32000, 8192)
    assert build_parser().parse_args(["serve", "--max-model-len", "4096"]).max_model_len == 4096
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", "lots"])


async def test_usage_token_ids_request_id_and_docs_flags(tiny_model):
    """--enable-force-include-usage, --return-tokens-as-token-ids (a request's false wins), --enable-request-id-headers,
    --disable-fastapi-docs and --stream-interval, as build_app takes them."""
    from aserve import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=128,
                                  served_model_name="tiny"))  # fmt: skip
    client = await make_client(engine, force_include_usage=True, return_tokens_as_token_ids=True,
                               request_id_headers=True, openapi=False, stream_interval=2)  # fmt: skip
    try:
        body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "logprobs": 1}
        resp = await client.post("/v1/completions", json={**body, "stream": True})
        events = [json.loads(e[6:]) for e in (await resp.text()).split("\n\n") if e.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["choices"] == []
        assert [len(e["choices"][0]["logprobs"]["tokens"]) for e in events[:-1]] == [1, 2]  # --stream-interval 2
        assert resp.headers["X-Request-Id"] == events[0]["id"].removeprefix("cmpl-")
        resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc"})
        whole = await resp.json()
        assert resp.headers["X-Request-Id"] == "abc" and whole["id"] == "cmpl-abc"
        assert all(t.startswith("token_id:") for t in whole["choices"][0]["logprobs"]["tokens"])
        plain = await (await client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False})).json()
        assert not any(t.startswith("token_id:") for t in plain["choices"][0]["logprobs"]["tokens"])
        assert (await client.get("/openapi.json")).status == 404
    finally:
        await client.close()


def test_vllm_flag_spellings_and_accepted_values(tiny_model, capsys):
    """Underscored flags (vLLM's FlexibleArgumentParser), --kv-cache-memory-bytes, and flags naming what aserve does
    anyway; other values refused at start-up."""
    from aserve.cli import build_parser, dashed, engine_args_from
    from aserve.entrypoints.openai.cli_args import check_frontend_args

    argv = ["serve", "--max_model_len=512", "--max_num_seqs", "4", "--kv-cache-memory-bytes", "512M",
            "--structured-outputs-config", '{"backend": "xgrammar"}', "--guided_decoding_backend", "auto",
            "--override-generation-config", '{"max_new_tokens": 7}', "--disable-uvicorn-access-log",
            "--max-log-len", "100"]  # fmt: skip
    ns = build_parser().parse_args(dashed(argv))
    check_frontend_args(ns)
    args = engine_args_from(ns)
    assert (args.max_model_len, args.max_num_seqs, args.kv_cache_budget_bytes) == (512, 4, 2**29)
    assert args.override_generation_config == {"max_new_tokens": 7}
    for flags, message in (
        (["--structured-outputs-config", '{"backend": "outlines"}'], "always uses xgrammar"),
        (["--guided-decoding-backend", "outlines"], "always uses xgrammar"),
        (["--kv-cache-memory-bytes", "1G", "--kv-cache-memory-gb", "1"], "not both"),
        (["--override-generation-config", '{"do_sample": true}'], "'do_sample' is not"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["serve", "--model", tiny_model, "--enforce-eager", *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


async def test_override_generation_config_caps_max_tokens(tiny_model):
    """max_new_tokens (the generation config's, or --override-generation-config's) caps every request's max_tokens,
    and sets the offline default, as in vLLM; the override's temperature is the default of requests that omit it."""
    from aserve import LLM

    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=128, served_model_name="tiny",
              override_generation_config={"max_new_tokens": 3, "temperature": 0.0})  # fmt: skip
    assert llm.get_default_sampling_params().max_tokens == 3 and llm.get_default_sampling_params().temperature == 0
    client = await make_client(llm.engine)
    try:
        for fields in ({}, {"max_tokens": 50}, {"max_tokens": 2}):
            body = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True, **fields}
            usage = (await (await client.post("/v1/chat/completions", json=body)).json())["usage"]
            assert usage["completion_tokens"] == min(3, fields.get("max_tokens", 3))
    finally:
        await client.close()
