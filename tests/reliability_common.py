"""What the reliability, request-fuzzing, KV-integrity and security tests share: a tiny-model engine with its
invariant checks on, the module's engine and HTTP client as fixtures, and readers of OpenAI error bodies and SSE
streams."""

import json

import pytest
from test_server import make_client

from aserve import EngineArgs, LLMEngine

MODEL = "tiny"


def make_llm_engine(tiny_model, **overrides) -> LLMEngine:
    args = dict(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, served_model_name=MODEL,
                debug_invariants=True)  # fmt: skip
    return LLMEngine(EngineArgs(**{**args, **overrides}))


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    return make_llm_engine(tiny_model)


@pytest.fixture
async def client(llm_engine):
    client = await make_client(llm_engine)
    yield client
    await client.close()


def assert_openai_error(body: dict, param=None) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def parse_sse(text: str) -> list:
    """data: lines -> JSON events, with the final "[DONE]" kept as a string."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text[:500]
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def stream_text(events: list) -> str:
    return "".join(c.get("text", "") for e in events if isinstance(e, dict) for c in e.get("choices", []))


def prompt_ids(i: int, n: int = 12) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 2 for j in range(n)]
