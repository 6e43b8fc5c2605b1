"""loadgen's SSE parser and streaming client, against a fake server that splits events across TCP writes, sends
keep-alive comments, errors mid-stream, closes early and goes silent. Every case is recorded, none hangs: each
request has short timeouts, and each test is bounded by asyncio.wait_for as well."""

import asyncio
import socket

import aiohttp
import pytest

from loadgen.client import Target, stream_request
from loadgen.fake_server import FakeServer
from loadgen.sse import SSEParser

STREAM = (
    b': hello\r\n\r\ndata: {"a": 1}\r\n\r\ndata: line one\ndata: line two\n\nevent: x\nid: 7\n'
    b"data:no-space \xc3\xa9\n\n: keep-alive\n\ndata: [DONE]\n\n"
)
EVENTS = ['{"a": 1}', "line one\nline two", "no-space \u00e9", "[DONE]"]


def test_sse_parser_whole_and_byte_by_byte():
    whole = SSEParser()
    assert whole.feed(STREAM) == EVENTS and whole.num_comments == 2 and whole.close() == []
    split = SSEParser()
    events = []
    for i in range(len(STREAM)):  # every split point, including inside CRLF and inside the two-byte é
        events += split.feed(STREAM[i : i + 1])
    assert events == EVENTS and split.num_comments == 2


def test_sse_parser_close_delivers_an_unterminated_event():
    parser = SSEParser()
    assert parser.feed(b"data: x\n\ndata: [DONE]") == ["x"]
    assert parser.close() == ["[DONE]"]
    parser = SSEParser()
    assert parser.feed(b"data: y\n") == [] and parser.close() == ["y"]


@pytest.fixture(params=[False, True], ids=["close-delimited", "chunked"])
async def fake(request):
    async with FakeServer(chunked=request.param) as server:
        yield server


async def send(url, prompt, max_tokens=5, endpoint="completions", total=5.0, read=2.0):
    target = Target(url=url, model="fake-model", endpoint=endpoint)
    async with aiohttp.ClientSession() as http:
        return await asyncio.wait_for(
            stream_request(http, target, target.body(prompt, max_tokens), total_timeout=total, read_timeout=read), 20
        )


async def test_normal_stream(fake):
    out = await send(fake.url, "hello", max_tokens=5)
    assert out.ok and out.error == "" and out.status == 200 and out.done
    assert out.text == "tok0 tok1 tok2 tok3 tok4 " and out.finish_reason == "length"
    assert (out.prompt_tokens, out.output_tokens) == (1, 5)
    assert len(out.chunk_times) == 5 and out.ttft == out.chunk_times[0] and out.chunk_times == sorted(out.chunk_times)
    assert 0 < out.ttft <= out.chunk_times[-1] <= out.e2e


async def test_chat_stream_skips_the_role_chunk(fake):
    out = await send(fake.url, "hello", max_tokens=3, endpoint="chat")
    assert out.ok and out.text == "tok0 tok1 tok2 " and len(out.chunk_times) == 3
    method, path, body = fake.requests[-1]
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 3


async def test_events_split_across_tcp_writes(fake):
    out = await send(fake.url, "#split", max_tokens=4)
    assert out.ok and out.text == "tok0 \u00e9tok2 tok3 " and len(out.chunk_times) == 4
    assert out.output_tokens == 4


async def test_keep_alive_comments_are_not_tokens(fake):
    out = await send(fake.url, "#keepalive", max_tokens=4)
    assert out.ok and len(out.chunk_times) == 4 and out.text == "tok0 tok1 tok2 tok3 "


async def test_error_event_mid_stream(fake):
    out = await send(fake.url, "#error", max_tokens=6)
    assert not out.ok and out.error == "error event: out of memory" and out.status == 200
    assert len(out.chunk_times) == 2 and out.ttft == out.chunk_times[0]


async def test_connection_closed_early(fake):
    out = await send(fake.url, "#close", max_tokens=6)
    assert not out.ok and len(out.chunk_times) == 2
    if fake.chunked:  # the chunked body is cut short
        assert out.error.startswith("connection closed mid-stream")
    else:  # a clean EOF, but no finish_reason and no [DONE]
        assert out.error == "connection closed before the stream finished"


async def test_silence_hits_the_read_timeout(fake):
    out = await send(fake.url, "#hang", max_tokens=6, read=0.3)
    assert not out.ok and out.error == "timed out: nothing from the server for 0.3 s"
    assert len(out.chunk_times) == 1 and out.ttft is not None and out.e2e >= 0.3
    out = await send(fake.url, "#stall", max_tokens=6, read=0.3)
    assert not out.ok and out.error.startswith("timed out") and out.ttft is None and out.chunk_times == []


async def test_keep_alive_forever_hits_the_total_timeout():
    async with FakeServer(token_delay=0.05) as fake:
        out = await send(fake.url, "#keepalive", max_tokens=1000, total=0.4, read=5.0)
    assert not out.ok and out.error == "timed out: the request took over 0.4 s"
    assert 0 < len(out.chunk_times) < 1000


async def test_http_error_malformed_event_and_missing_usage(fake):
    out = await send(fake.url, "#http500")
    assert not out.ok and out.status == 500 and out.error == "HTTP 500: the engine fell over"
    assert out.ttft is None and out.chunk_times == []
    out = await send(fake.url, "#garbage", max_tokens=4)
    assert not out.ok and out.error == "malformed event: '{not json'" and len(out.chunk_times) == 1
    out = await send(fake.url, "#nousage", max_tokens=4)
    assert out.ok and out.output_tokens is None and len(out.chunk_times) == 4


async def test_unreachable_server():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = await send(f"http://127.0.0.1:{port}", "x")
    assert not out.ok and out.error.startswith(f"cannot connect to http://127.0.0.1:{port}") and out.status == 0


def test_request_bodies():
    target = Target(
        url="http://h",
        model="m",
        endpoint="completions",
        ignore_eos=True,
        temperature=0.5,
        extra_body={"top_k": 3, "temperature": 0.7},
        api_key="k",
    )
    assert target.body([1, 2], 4) == {
        "model": "m",
        "max_tokens": 4,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": [1, 2],
        "ignore_eos": True,
        "top_k": 3,
    }
    assert target.headers() == {"Authorization": "Bearer k"} and target.path == "/v1/completions"
    chat = Target(url="http://h", model="m", endpoint="chat")
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert chat.body(history, 2)["messages"] == history and "ignore_eos" not in chat.body("x", 2)
    assert chat.body("x", 2)["messages"] == [{"role": "user", "content": "x"}] and chat.headers() == {}
