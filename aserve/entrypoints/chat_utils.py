"""Chat messages as OpenAI clients send them -> the shape chat templates take (shared by /v1/chat/completions,
/tokenize and the offline `LLM.chat`)."""

from __future__ import annotations

from aserve.entrypoints.openai.tool_request import template_message
from aserve.sampling_params import ParamError


def parse_conversation(messages: list[dict]) -> list[dict]:
    """Each message with a string role and string content: OpenAI's text content parts joined with newlines (as vLLM
    joins them), null content as ""; earlier tool calls in the shape templates render. ParamError names the message
    that is not one."""
    if not messages:
        raise ParamError("messages", "messages must not be empty")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ParamError(f"messages[{i}]", "every message must be an object with a role and content")
        role = msg.get("role")
        if not isinstance(role, str):
            raise ParamError(f"messages[{i}].role", "every message needs a string role")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ParamError(f"messages[{i}].content", "only text content parts are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ParamError(f"messages[{i}].content", "content must be a string or a list of text parts")
        msg = {**msg, "role": role, "content": content or ""}
        out.append(template_message(msg) if msg.get("tool_calls") else msg)
    return out
