"""POST /invocations (vLLM's SageMaker route) and the refusal of bodies not declared JSON, driven over HTTP."""

import json

import pytest
from test_server import MODEL, assert_idle, make_client

from aserve import EngineArgs, LLMEngine


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    return LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=256,
                                served_model_name=MODEL))  # fmt: skip


@pytest.fixture
async def client(llm_engine):
    client = await make_client(llm_engine)
    yield client
    await client.close()


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
COMPLETION = {"prompt": "The sky is", "max_tokens": 5, "temperature": 0, "ignore_eos": True}


async def test_invocations_route_by_body(client, llm_engine):
    """A body with messages is a chat completion, one with a prompt a completion: the same answers as their own
    routes give, streamed or not."""
    for route, body, kind in (("/v1/chat/completions", CHAT, "chat.completion"),
                              ("/v1/completions", COMPLETION, "text_completion")):  # fmt: skip
        direct = await (await client.post(route, json=body)).json()
        resp = await client.post("/invocations", json=body)
        assert resp.status == 200, await resp.text()
        got = await resp.json()
        assert got["object"] == kind and got["choices"] == direct["choices"] and got["usage"] == direct["usage"]
        resp = await client.post("/invocations", json={**body, "stream": True})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        text = await resp.text()
        assert text.endswith("data: [DONE]\n\n")
        chunks = [json.loads(e[6:]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
        pieces = [c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or ""
                  for c in chunks if c["choices"]]  # fmt: skip
        whole = direct["choices"][0]["message"]["content"] if "message" in direct["choices"][0] else None
        assert "".join(pieces) == (whole if whole is not None else direct["choices"][0]["text"])
    assert_idle(llm_engine)


async def test_invocations_bad_bodies(client, llm_engine):
    resp = await client.post("/invocations", json={"max_tokens": 3})
    assert resp.status == 400
    assert "Cannot find suitable handler" in (await resp.json())["error"]["message"]
    resp = await client.post("/invocations", json=[1, 2])
    assert resp.status == 400 and "error" in await resp.json()
    resp = await client.post("/invocations", data=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
    resp = await client.post("/invocations", json={**COMPLETION, "bogus": 1})  # the routed parse names the field
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "bogus"
    assert (await client.post("/invocations", json=COMPLETION)).status == 200
    assert_idle(llm_engine)


async def test_invocations_needs_the_api_key(llm_engine):
    client = await make_client(llm_engine, api_key="sekrit")
    try:
        resp = await client.post("/invocations", json=COMPLETION)
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        resp = await client.post("/invocations", json=COMPLETION, headers={"Authorization": "Bearer sekrit"})
        assert resp.status == 200
    finally:
        await client.close()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/invocations"])
async def test_bodies_not_declared_json_are_refused(client, llm_engine, route):
    """A form post, plain text or no Content-Type: 400 as vLLM answers it, whatever the body holds; a JSON media type
    with parameters is JSON."""
    body = json.dumps(CHAT if "chat" in route else {"prompt": "x"} if route == "/tokenize" else COMPLETION).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": content_type} if content_type else {}
        resp = await client.post(route, data=body, headers=headers, skip_auto_headers=["Content-Type"])
        assert resp.status == 400, (content_type, await resp.text())
        error = (await resp.json())["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    resp = await client.post(route, data=body, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert resp.status == 200, await resp.text()
    assert_idle(llm_engine)
