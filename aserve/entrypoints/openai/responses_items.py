"""The Responses API's items: a conversation's input items (messages, earlier function calls and their outputs,
reasoning) as the chat messages a chat template renders, and the output items a reply becomes (reasoning, an
assistant message with its output_text, function calls).

    input item                                        chat message
    {"role": r, "content": "..." | [input_text...]}    {"role": r, "content": [text parts]}
    {"type": "reasoning", "content": [...]}           an assistant message's reasoning_content
    {"type": "function_call", "call_id", ...}         an assistant message's tool_calls (calls in a row: one message)
    {"type": "function_call_output", "call_id", ...}  {"role": "tool", "tool_call_id", "content"}

Items carry ids, statuses and annotations that only describe them (a client sends an earlier response's output
back as it got it): they are read past."""

from __future__ import annotations

import uuid

from aserve.sampling_params import ParamError

# the statuses of responses and of their items
COMPLETED, INCOMPLETE, IN_PROGRESS, FAILED = "completed", "incomplete", "in_progress", "failed"
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# an assistant message a client left unfinished (vLLM continues it rather than starting a new one)
_OPEN_STATUSES = (IN_PROGRESS, INCOMPLETE)


def new_item_id(prefix: str) -> str:
    """An output item's id: msg_..., rs_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_parts(content, where: str) -> list[dict]:
    """A message's content (a string, or text parts) as chat text parts; `where`: the field (for errors)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ParamError(where, "content must be a string or a list of input_text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ParamError(f"{where}[{j}]", f"content part type {kind!r} is not supported: aserve takes "
                             "text (input_text, output_text)")  # fmt: skip
    return parts


def _reasoning_text(item: dict, where: str) -> str:
    if item.get("encrypted_content"):
        raise ParamError(f"{where}.encrypted_content", "encrypted reasoning is not supported: send the reasoning "
                         "item's content as aserve returned it")  # fmt: skip
    for key in ("content", "summary"):  # vLLM falls back to the summary
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):  # fmt: skip
            raise ParamError(f"{where}.{key}", f"a reasoning item's {key} must be a list of parts, each with a "
                             "string text")  # fmt: skip
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ParamError(f"{where}.{key}", f"a function_call item needs a string {key}")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}  # fmt: skip


def _tool_output(item: dict, where: str) -> dict:
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(p["text"] for p in _text_parts(output, f"{where}.output"))
    if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
        raise ParamError(where, "a function_call_output item needs a string call_id and output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _open_assistant(messages: list[dict]) -> dict | None:
    """The last message if it is the assistant's (a reasoning item, text and calls of one turn join it)."""
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def chat_messages(items: list, start: int = 0) -> list[dict]:
    """Conversation items -> chat messages (the module's table). `start`: the index of items[0] in the request's
    `input` (what an error names)."""
    messages: list[dict] = []
    for i, item in enumerate(items, start):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ParamError(where, "each input item must be an object")
        kind = item.get("type", "message")
        last = _open_assistant(messages)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ParamError(f"{where}.role", f"role must be one of {', '.join(_ROLES)}, got {role!r}")
            parts = _text_parts(item.get("content"), f"{where}.content")
            if role == "assistant" and last is not None and "reasoning_content" in last and not last["content"] and (
                    "tool_calls" not in last):  # fmt: skip
                last["content"] = parts  # the text after this turn's reasoning
            else:
                messages.append({"role": role, "content": parts})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if last is not None and "reasoning_content" not in last and not last["content"]:
                last["reasoning_content"] = text
            else:
                messages.append({"role": "assistant", "content": [], "reasoning_content": text})
        elif kind == "function_call":
            call = _function_call(item, where)
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": [], "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_tool_output(item, where))
        else:
            raise ParamError(f"{where}.type", f"input item type {kind!r} is not supported: aserve takes message, "
                             "reasoning, function_call and function_call_output items")  # fmt: skip
    return messages


def continues_last(items: list) -> bool:
    """Whether the conversation ends with an assistant message left unfinished (status in_progress or incomplete):
    the reply continues it, as vLLM's does."""
    last = items[-1] if items else None
    return (isinstance(last, dict) and last.get("type", "message") == "message" and last.get("role") == "assistant"
            and last.get("status") in _OPEN_STATUSES)  # fmt: skip


# -- output items --------------------------------------------------------------------------------------------------


def response_status(finish_reason: str | None) -> str:
    """A reply cut off by max_output_tokens (or the context) is incomplete."""
    return INCOMPLETE if finish_reason == "length" else COMPLETED


def output_text(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str | None, logprobs: list | None = None, status: str = COMPLETED) -> dict:
    """An assistant message item; `text` None: no content yet (a stream's item just added)."""
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str = COMPLETED) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "encrypted_content": None,
            "status": status}  # fmt: skip


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = COMPLETED) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def output_items(message: dict, logprobs: dict | None, status: str) -> list[dict]:
    """A chat reply's message (content, reasoning, tool_calls, as the chat path made it) -> output items: its
    reasoning, its text, its calls, in the order written; a reply with none of them is one empty message.
    `logprobs`: the chat choice's ({"content": [...]}), given to the text."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_item_id("rs"), message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (items or calls):
        lp = logprobs["content"] if logprobs else None
        items.append(message_item(new_item_id("msg"), message.get("content") or "", lp, status))
    for call in calls:
        function = call["function"]
        items.append(function_call_item(new_item_id("fc"), call["id"], function["name"], function["arguments"]))
    return items
