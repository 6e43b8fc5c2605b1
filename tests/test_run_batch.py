"""`aserve run-batch` (vLLM's OpenAI batch runner): every line of an input file answered as the server answers the
same request over HTTP, in input order, in vLLM's output shape; a bad line is an error line, not the end of the run;
URLs refused (no network)."""

import asyncio
import json

import pytest
from test_server import make_client

from aserve import EngineArgs, LLMEngine
from aserve.cli import main as cli_main

FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--disable-log-stats",
         "--served-model-name", "tiny"]  # fmt: skip
CHAT = [{"role": "user", "content": "Hi there"}]
REQUESTS = [
    {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 1}},
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}},
    {"custom_id": "prompts", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": ["a", [5, 6, 7]], "max_tokens": 3, "temperature": 0, "ignore_eos": True}},
]  # fmt: skip
BAD = [
    ("not json", None, 400, "not JSON"),
    ('{"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {}}', "e", 400, "Supported endpoints"),
    ('{"custom_id": "g", "method": "GET", "url": "/v1/completions", "body": {}}', "g", 400, "method must be POST"),
    ('{"custom_id": "s", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stream": true}}', "s",
     400, "must not be sent in stream mode"),
    ('{"custom_id": "m", "method": "POST", "url": "/v1/completions", "body": {"model": "nope", "prompt": "x"}}', "m",
     404, "does not exist"),
    ('{"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}', "t",
     400, "temperature"),
]  # fmt: skip


def same_answer(a, b) -> bool:
    """Two answers to one request alike but for their ids and times, and logprobs within float error (the batch
    file's requests run batched together, the HTTP ones one at a time)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) - {"id", "created"}
        return keys == set(b) - {"id", "created"} and all(same_answer(a[k], b[k]) for k in keys)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same_answer, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, abs=1e-4)
    return a == b


def test_run_batch_answers_as_the_server_does(tiny_model, tmp_path):
    lines = [json.dumps(r) for r in REQUESTS[:2]] + [bad[0] for bad in BAD] + ["", json.dumps(REQUESTS[2])]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    cli_main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", tiny_model, *FLAGS])
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["cmpl", "chat", *[b[1] for b in BAD], "prompts"]  # input order
    assert len({r["id"] for r in results}) == len({r["response"]["request_id"] for r in results}) == len(results)
    expected = asyncio.run(answers_over_http(tiny_model))
    for result, body in zip([*results[:2], results[-1]], expected):
        assert result["error"] is None and result["response"]["status_code"] == 200, result
        assert same_answer(result["response"]["body"], body), (result, body)
    for result, (_, _, status, message) in zip(results[2:-1], BAD):
        assert result["response"]["status_code"] == status and result["response"]["body"] is None
        error = result["error"] if isinstance(result["error"], str) else result["error"]["error"]["message"]
        assert message in error, result


async def answers_over_http(tiny_model) -> list[dict]:
    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=128,
                                  served_model_name="tiny"))  # fmt: skip
    client = await make_client(engine)
    try:
        return [await (await client.post(r["url"], json=r["body"])).json() for r in REQUESTS]
    finally:
        await client.close()


@pytest.mark.parametrize("files, message", [
    (["-i", "https://example.com/in.jsonl", "-o", "out.jsonl"], "local files only"),
    (["-i", "IN", "-o", "s3://bucket/out.jsonl"], "local files only"),
    (["-i", "/nonexistent/in.jsonl", "-o", "out.jsonl"], "no such file"),
    (["-i", "IN", "-o", "out.jsonl", "--enable-metrics"], "serves no Prometheus metrics"),
])  # fmt: skip
def test_refused_before_the_model_loads(tmp_path, capsys, files, message):
    (tmp_path / "in.jsonl").write_text("")
    files = [str(tmp_path / "in.jsonl") if f == "IN" else f for f in files]
    with pytest.raises(SystemExit) as e:
        cli_main(["run-batch", *files, "--model", "/nonexistent/model"])
    assert e.value.code == 2 and message in capsys.readouterr().err


GOOD_LINE = json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "Hello", "max_tokens": 2}}).encode()  # fmt: skip


@pytest.mark.parametrize("line, custom_id, message", [
    (b'{"custom_id": "\xff\xfe", "method": "POST"}', None, "not UTF-8"),
    (b'{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     None, "nested too deeply"),
    # a custom_id UTF-8 cannot hold (a lone surrogate) comes back escaped, as it came
    (b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/embeddings", "body": {}}', "\ud800",
     "Supported endpoints"),
], ids=["not-utf8", "too-deep", "lone-surrogate"])  # fmt: skip
def test_a_line_that_cannot_be_read_or_echoed_is_an_error_line(tiny_model, tmp_path, line, custom_id, message):
    """A line that cannot even be read as a request, or whose custom_id cannot be written as UTF-8, gets its 400
    like any bad line; the lines around it are answered."""
    (tmp_path / "in.jsonl").write_bytes(GOOD_LINE + b"\n" + line + b"\n" + GOOD_LINE + b"\n")
    out = tmp_path / "out.jsonl"
    cli_main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", tiny_model, *FLAGS])
    first, bad, last = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert first["response"]["status_code"] == last["response"]["status_code"] == 200
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"] is None and message in bad["error"]
    assert bad["custom_id"] == custom_id
