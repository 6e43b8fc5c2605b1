"""Chat content parts that carry text, as the official openai client sends a conversation back: OpenAI's `refusal`
parts (an assistant's refused turn in the history), the Responses API's `input_text` / `output_text`, `thinking`
and bare strings read as text, as vLLM reads them; parts with no text side (images) stay a 400 naming the message."""

import pytest
from test_responses_api import MODEL, client, clients, llm_engine  # noqa: F401  (the fixtures)
from test_server import assert_idle

openai = pytest.importorskip("openai")


async def reply(openai_client, history):
    """(prompt token ids, text) of a greedy 4-token reply."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    resp = await openai_client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0,
                                                       extra_body=extra)  # fmt: skip
    return resp.prompt_token_ids, resp.choices[0].message.content


def history(assistant_content, user_content="Try again"):
    return [{"role": "user", "content": "Tell me a secret"}, {"role": "assistant", "content": assistant_content},
            {"role": "user", "content": user_content}]  # fmt: skip


async def test_text_like_parts_render_as_their_text(client, llm_engine):  # noqa: F811
    refused, other = "I can't share that.", "Ask me something else"
    plain = await reply(client, history(f"{refused}\n{other}"))
    assert len(plain[0]) > 10
    for parts in (
        [{"type": "refusal", "refusal": refused}, {"type": "text", "text": other}],
        [{"type": "output_text", "text": refused}, other],
        [{"type": "thinking", "thinking": refused}, {"type": "input_text", "text": other}],
        # a text or refusal part with null text is skipped, as vLLM skips it
        [{"type": "refusal", "refusal": None}, {"type": "text", "text": f"{refused}\n{other}"}],
    ):
        assert await reply(client, history(parts)) == plain, parts
    user_parts = [{"type": "input_text", "text": "Try"}, {"type": "text", "text": "again"}]
    assert await reply(client, history("x", user_parts)) == await reply(client, history("x", "Try\nagain"))
    assert_idle(llm_engine)


async def test_parts_without_text_are_refused(client, llm_engine):  # noqa: F811
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    for part, named in ((image, "'image_url'"), ({"type": "refusal", "refusal": 5}, None), (7, None)):
        with pytest.raises(openai.BadRequestError) as err:
            await reply(client, history("ok", [{"type": "text", "text": "Look"}, part]))
        assert err.value.body["param"] == "messages[2].content"
        assert "only text content parts are supported" in err.value.body["message"]
        assert named is None or named in err.value.body["message"]
    assert_idle(llm_engine)
