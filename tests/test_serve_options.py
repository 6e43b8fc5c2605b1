"""`aserve serve`'s listener and app flags from vLLM: TLS (--ssl-*) answering the official openai client over https,
--root-path, --enable-server-load-tracking (GET /load), --chat-template-content-format, --middleware, the logging and
HTTP parser flags, the flags accepted without an effect and the ones refused, started from a --config YAML file as
vLLM deployments start it."""

import datetime
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest
from aserve_server import running_server, start_server, stop_server
from test_server import make_client

from aserve import EngineArgs, LLMEngine
from aserve.cli import main as cli_main
from aserve.entrypoints.openai.serve_options import ServeOptions

# takes a string, or loops over content parts (as Gemma 3's does): auto detects the loop and passes the list
LOOPING_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                    "{% for p in m['content'] %}{{ p['text'] }}|{% endfor %}{% endif %}{% endfor %}")  # fmt: skip


def self_signed(directory) -> tuple[str, str]:
    """(certificate, key) PEM files for 127.0.0.1 and localhost: made with `cryptography`, else the openssl command;
    the test skips without either."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is here to make a certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)  # fmt: skip
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1)).add_extension(names, critical=False)
                   .sign(private, hashes.SHA256()))  # fmt: skip
    with open(cert, "wb") as f:
        f.write(certificate.public_bytes(serialization.Encoding.PEM))
    with open(key, "wb") as f:
        f.write(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))  # fmt: skip
    return cert, key


def test_https_root_path_and_load_from_a_config_file(tiny_model, tmp_path):
    from openai import AuthenticationError, DefaultHttpxClient, OpenAI

    cert, key = self_signed(tmp_path)
    (tmp_path / "template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {tiny_model}\ndtype: float32\nenforce_eager: true\nmax-model-len: 64\n"
                      f"ssl-certfile: {cert}\nssl-keyfile: {key}\nroot-path: /api/\nenable-server-load-tracking: true\n"
                      f"served-model-name: [tiny, other]\napi-key: [k]\nchat-template: {tmp_path / 'template.jinja'}\n"
                      "chat-template-content-format: openai\nshow-hidden-metrics-for-version: '0.9'\n")  # fmt: skip
    tls = ssl.create_default_context(cafile=cert)
    # the command line's --max-model-len wins over the file's
    with running_server("--config", str(config), "--max-model-len", "128", tls=tls) as url:
        for base in (f"{url}/api/v1", f"{url}/v1"):  # under the root path, and as a proxy that strips it sends them
            client = OpenAI(base_url=base, api_key="k", http_client=DefaultHttpxClient(verify=tls))
            assert [m.id for m in client.models.list().data] == ["tiny", "other"]
            assert client.models.retrieve("tiny").model_extra["max_model_len"] == 128
            completion = client.completions.create(model="other", prompt="Hi", max_tokens=3, extra_body={
                "ignore_eos": True})  # fmt: skip
            assert completion.model == "tiny" and completion.usage.completion_tokens == 3
            chat = client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user",
                                                                                         "content": "Hi"}])  # fmt: skip
            assert chat.choices[0].message.role == "assistant"
            with pytest.raises(AuthenticationError):  # the API key guards /api/v1 as it guards /v1
                OpenAI(base_url=base, api_key="wrong", http_client=DefaultHttpxClient(verify=tls)).models.list()
        with urllib.request.urlopen(f"{url}/api/load", context=tls) as resp:
            assert json.loads(resp.read()) == {"server_load": 0}
        # openai: the content parts reach the template as a list, which this template prints as it is
        body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}).encode()
        req = urllib.request.Request(f"{url}/tokenize", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=tls) as resp:
            tokens = json.loads(resp.read())["tokens"]
        req = urllib.request.Request(f"{url}/detokenize", data=json.dumps({"tokens": tokens}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, context=tls) as resp:
            assert json.loads(resp.read())["prompt"] == "[{'type': 'text', 'text': 'a'}]"
        with pytest.raises(OSError):  # plain HTTP to the TLS port gets no answer
            urllib.request.urlopen(url.replace("https", "http") + "/health", timeout=5)


async def test_content_format_string_joins_parts_for_every_template(tiny_model):
    """string: content parts joined with newlines even for a template that loops over them (auto passes it the
    list); openai: every content a list, a string one part (vLLM's); a request's own template too."""
    from transformers import AutoTokenizer

    from aserve.entrypoints.openai.server_state import STATE_KEY

    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=128))
    engine.config.tokenizer.chat_template = LOOPING_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}]  # fmt: skip
    for content_format, rendered in (("auto", "a|b|c"), ("string", "a\nbc"), ("openai", "a|b|c|")):
        client = await make_client(engine, trust_request_chat_template=True)
        try:
            ServeOptions(content_format=content_format).setup_app(client.server.app)
            assert client.server.app[STATE_KEY].content_format == content_format
            for extra in ({}, {"chat_template": LOOPING_TEMPLATE}):
                resp = await client.post("/tokenize", json={"messages": messages, **extra})
                tokens = (await resp.json())["tokens"]
                assert tokenizer.decode(tokens) == rendered, (content_format, extra)
        finally:
            await client.close()


MIDDLEWARE = """
async def tag(request, handler):
    if request.path == "/v1/boom":
        raise ValueError("a bad thing from the middleware")
    response = await handler(request)
    response.headers["X-Tagged"] = request.method
    return response
"""
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | length }}: {% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)


def test_middleware_logging_and_parser_limits(tiny_model, tmp_path, monkeypatch):
    """--middleware (an aiohttp middleware by import path, inside the error handling), --log-error-stack,
    --enable-log-outputs cut to --max-log-len, --h11-max-header-count, --h11-max-incomplete-event-size and
    --exclude-tools-when-tool-choice-none, driven through the openai client and raw HTTP."""
    import http.client

    from openai import BadRequestError, OpenAI

    (tmp_path / "aserve_test_middleware.py").write_text(MIDDLEWARE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "tools.jinja").write_text(TOOLS_TEMPLATE)
    log = tmp_path / "server.log"
    proc, url = start_server(tiny_model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
                             "--middleware", "aserve_test_middleware.tag", "--log-error-stack", "--enable-log-outputs",
                             "--max-log-len", "2", "--h11-max-header-count", "40",
                             "--h11-max-incomplete-event-size", "2000", "--chat-template",
                             str(tmp_path / "tools.jinja"), "--exclude-tools-when-tool-choice-none",
                             log_path=str(log))  # fmt: skip
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id
        raw = client.completions.with_raw_response.create(model=model, prompt="Hi", max_tokens=4,
                                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert raw.headers["X-Tagged"] == "POST"
        completion = raw.parse()
        with pytest.raises(BadRequestError, match="a bad thing from the middleware"):
            client.post("/boom", cast_to=object, body={})
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "Hello"}]
        prompt_tokens = {choice: client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                                                tools=tools, tool_choice=choice).usage.prompt_tokens
                         for choice in ("none", "required")}  # fmt: skip
        plain = client.chat.completions.create(model=model, messages=messages, max_tokens=1).usage.prompt_tokens
        assert prompt_tokens["none"] == plain < prompt_tokens["required"]
        for count, size, status in ((30, 1000, 200), (50, 1, 400), (1, 3000, 400)):
            conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
            conn.putrequest("GET", "/health")
            for i in range(count):
                conn.putheader(f"X-Extra-{i}", "v" * size)
            conn.endheaders()
            assert conn.getresponse().status == status, (count, size)
            conn.close()
        assert client.models.list().data  # still serving
    finally:
        stop_server(proc)
    text = log.read_text()
    assert "Traceback" in text and "ValueError: a bad thing from the middleware" in text
    logged = (
        f"output of {completion.id} (choice 0): 4 tokens, finish_reason length, text {completion.choices[0].text[:2]!r}"
    )
    assert logged in text


def test_dev_mode_routes_reset_the_prefix_cache(tiny_model, monkeypatch):
    """VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache makes the next identical prompt compute from scratch (usage's
    cached tokens), GET /server_info the resolved arguments, no sleep mode; without it the routes are 404."""
    from openai import OpenAI

    def call(url, path, method="POST"):
        req = urllib.request.Request(url + path, data=b"" if method == "POST" else None, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    prompt = " ".join(["alpha beta gamma delta"] * 10)
    args = ("--model", tiny_model, "--enforce-eager", "--max-model-len", "256", "--enable-prompt-tokens-details",
            "--hf-token", "hf_secret")  # fmt: skip
    with running_server(*args) as url:
        assert call(url, "/reset_prefix_cache")[0] == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with running_server(*args) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id

        def cached() -> int:
            usage = client.completions.create(model=model, prompt=prompt, max_tokens=1).usage
            return usage.prompt_tokens_details.cached_tokens

        assert cached() == 0 and cached() > 0
        assert call(url, "/reset_prefix_cache") == (200, b"")
        assert cached() == 0 and cached() > 0
        status, body = call(url, "/server_info", "GET")
        info = json.loads(body)["aserve_config"]
        assert status == 200 and info["max_model_len"] == 256 and info["hf_token"] == "<withheld>"
        assert b"hf_secret" not in body
        assert json.loads(call(url, "/is_sleeping", "GET")[1]) == {"is_sleeping": False}
        status, body = call(url, "/sleep")
        assert status == 400 and "no sleep mode" in json.loads(body)["error"]["message"]


PLUGIN = """
import json

from aserve.entrypoints.openai.tool_parsers import ToolCall, ToolParser


class ShoutParser(ToolParser):
    name = "shout"
    aliases = ("shout_v2",)

    def extract(self, text):
        return "", [ToolCall("shout", json.dumps({"words": text}))]
"""


def test_tool_parser_plugin_registers_its_parsers(tiny_model, tmp_path):
    """--tool-parser-plugin FILE: the ToolParser subclasses it defines answer to their names in --tool-call-parser:
    every reply of this one is a call to `shout` with the generated text, through the openai client."""
    from openai import OpenAI

    plugin = tmp_path / "shout_plugin.py"
    plugin.write_text(PLUGIN)
    args = ("--model", tiny_model, "--enforce-eager", "--max-model-len", "256", "--tool-parser-plugin", str(plugin),
            "--tool-call-parser", "shout_v2", "--enable-auto-tool-choice")  # fmt: skip
    with running_server(*args) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id
        tools = [{"type": "function", "function": {"name": "shout", "parameters": {"type": "object"}}}]
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], tools=tools,
                                               max_tokens=5, extra_body={"ignore_eos": True})  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "shout"
    assert reply.usage.completion_tokens == 5 and json.loads(call.function.arguments)["words"]


def test_a_vllm_tool_parser_plugin_is_refused_by_name(tiny_model, tmp_path, capsys):
    plugin = tmp_path / "vllm_plugin.py"
    plugin.write_text("from vllm.tool_parsers import ToolParser, ToolParserManager\n")
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", tiny_model, "--tool-parser-plugin", str(plugin), "--tool-call-parser", "mine"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--tool-parser-plugin {plugin}: importing it failed (ModuleNotFoundError" in err
    assert "subclasses aserve.entrypoints.openai.tool_parsers.ToolParser" in err


@pytest.mark.parametrize("flags, message", [
    (["--otlp-traces-endpoint", "http://collector:4317"], "exports no OpenTelemetry traces"),
    (["--api-server-count", "2"], "one API server process"),
    (["--headless"], "no engine without its API server"),
    (["--middleware", "aserve_no_such_module.mw"], "--middleware aserve_no_such_module.mw: cannot import it"),
    (["--middleware", "collections.OrderedDict"], "ASGI middleware classes do not apply"),
    (["--middleware", "json.dumps"], "a middleware is an async function"),
    (["--h11-max-header-count", "0"], "--h11-max-header-count must be at least 1"),
    (["--max-log-len", "-1"], "--max-log-len must be at least 0"),
    (["--tool-call-parser", "nonesuch"], "--tool-call-parser nonesuch: not a tool-call parser here"),
    (["--tool-parser-plugin", "/nonexistent/plugin.py"], "--tool-parser-plugin /nonexistent/plugin.py: no such"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "/nonexistent/cert.pem"], "TLS (--ssl-certfile /nonexistent/cert.pem"),
    (["--ssl-certfile", "c.pem", "--enable-ssl-refresh"], "reads its certificates once"),
    (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"], "against --ssl-ca-certs"),
    (["--root-path", "api"], "--root-path must start with '/'"),
    (["--chat-template-content-format", "json"], "invalid choice: 'json'"),
])  # fmt: skip
def test_refused_at_start_up(tiny_model, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", tiny_model, *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
