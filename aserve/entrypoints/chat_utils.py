"""Chat messages as OpenAI clients send them -> the shape chat templates take (shared by /v1/chat/completions,
/tokenize and the offline `LLM.chat`)."""

from __future__ import annotations

import re

from aserve.entrypoints.openai.tool_request import template_message
from aserve.sampling_params import ParamError

# A template that loops over a message's content takes OpenAI's content parts as they are (vLLM's "openai" content
# format, which it detects the same way): Gemma 3's renders each part's text
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+[\w.]+(\[\s*['\"]content['\"]\s*\]|\.content)")


def takes_content_parts(template: str | dict | None) -> bool:
    """Does this chat template (or any of a tokenizer's named templates) read a message's content as a list of
    parts?"""
    if isinstance(template, dict):
        return any(takes_content_parts(t) for t in template.values())
    return isinstance(template, str) and _LOOPS_OVER_CONTENT.search(template) is not None


# Content parts read as text, by type: the field holding the text. vLLM reads these the same way: `refusal` is how an
# assistant's refused turn comes back in an OpenAI history, `input_text` / `output_text` are the Responses API's parts.
_TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                     "thinking": "thinking"}  # fmt: skip


def _part_text(i: int, part) -> str | None:
    """A content part's text (a bare string is one); None for a text or refusal part whose text is null (vLLM skips
    those). ParamError for any other part: images, audio and files have no text side here."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    field = _TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
    text = part.get(field) if field is not None else None
    if text is None and kind in ("text", "refusal"):
        return None
    if not isinstance(text, str):
        raise ParamError(f"messages[{i}].content", "only text content parts are supported" + (
            f" (this one is {kind[:40]!r}: aserve serves a model's text side only)" if isinstance(kind, str)
            and field is None else ""))  # fmt: skip
    return text


def parse_conversation(messages: list[dict], keep_parts: bool = False, all_parts: bool = False) -> list[dict]:
    """Each message with a string role and string content: OpenAI's text content parts joined with newlines (as vLLM
    joins them for templates that take a string), or with `keep_parts` (takes_content_parts) kept as a list of text
    parts; null content as ""; earlier tool calls in the shape templates render. `all_parts` (vLLM's "openai" content
    format): every content a list of text parts, a string one part and null none. ParamError names the message that
    is not one."""
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
            texts = [text for text in (_part_text(i, part) for part in content) if text is not None]
            content = [{"type": "text", "text": t} for t in texts] if keep_parts or all_parts else "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ParamError(f"messages[{i}].content", "content must be a string or a list of text parts")
        elif all_parts:
            content = [{"type": "text", "text": content}] if content is not None else []
        msg = {**msg, "role": role, "content": content if all_parts else content or ""}
        out.append(template_message(msg) if msg.get("tool_calls") else msg)
    return out
