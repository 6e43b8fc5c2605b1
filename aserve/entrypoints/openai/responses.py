"""What the server sends back: the OpenAI API's response bodies (completions and chat completions, whole or as stream
chunks, with logprobs and usage; error bodies) and their server-sent events (a stream's are written by
event_stream.py)."""

from __future__ import annotations

import msgspec

from aserve.core.outputs import CLIENT_ERRORS
from aserve.entrypoints.openai.prompt_scoring import Echo
from aserve.outputs import CompletionOutput, Logprob, RequestOutput

_encode = msgspec.json.encode

DONE = b"data: [DONE]\n\n"


class ChoiceState:
    """One choice of a response: everything generated so far, and the part not yet sent (for streams)."""

    def __init__(self, index: int, num_top: int | None) -> None:
        self.index = index
        self.want_logprobs = num_top is not None
        self.num_top = num_top or 0  # top alternatives per token, when logprobs are asked for
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[dict[int, Logprob]] = []
        self.token_ids: list[int] = []
        self.delta_text = ""
        self.delta_token_ids: list[int] = []
        self.delta_logprobs: list[dict[int, Logprob]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_status = 500  # 500: an internal fault; 503: the server ended the request (shutting down); 400:
        # the request's own constraints conflict (core.outputs.CLIENT_ERRORS)
        self.echo: Echo | None = None  # completions' echo: the prompt goes first (prompt_scoring.Echo)
        self.prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, once known (reported once)
        self.prompt_logprobs_sent = False
        self.prompt_token_ids: list[int] = []  # the prompt as it ran (return_token_ids; its length: usage)
        self.prompt_token_ids_sent = False
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache
        self.output_token_ids: list[int] = []  # generated tokens only (token_ids may start with an echoed prompt)
        self.delta_output_token_ids: list[int] = []
        self.ids_as_tokens = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:N"
        self.chunks_sent = 0  # stream events with this choice's tokens sent so far

    def add(self, comp: CompletionOutput, error: str | None) -> None:
        """Adds an output's delta; deltas gather until `clear_delta` (a stream sent them)."""
        if self.echo is not None:
            comp = self.echo.apply(self, comp)
        self.output_token_ids += comp.token_ids
        self.delta_output_token_ids += comp.token_ids
        self.delta_text += comp.text
        self.delta_token_ids += comp.token_ids
        if comp.logprobs:
            self.delta_logprobs += comp.logprobs
        self.text += comp.text
        self.token_ids += comp.token_ids
        self.num_tokens += len(comp.token_ids)
        self.logprobs += comp.logprobs or []
        if comp.finish_reason is not None:
            self.finish_reason, self.stop_reason = comp.finish_reason, comp.stop_reason
            if comp.finish_reason == "error":
                self.error = error or "the request failed"
                if error in CLIENT_ERRORS:
                    self.error_status = 400
            elif comp.finish_reason == "abort":  # clients never see their own aborts: the server ended it
                self.error, self.error_status = error or "the request was aborted", 503

    def clear_delta(self) -> None:
        self.delta_text, self.delta_token_ids, self.delta_logprobs = "", [], []
        self.delta_output_token_ids = []


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object, for error responses and for the last event of a stream that failed."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          completion_details: dict | None = None) -> dict:  # fmt: skip
    """OpenAI's usage object; with `cached_tokens` (--enable-prompt-tokens-details), prompt_tokens_details too; with
    `completion_details` (a reasoning parser's reasoning_tokens), completion_tokens_details."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if completion_details is not None:
        out["completion_tokens_details"] = completion_details
    return out


def cached_tokens(choices: list[ChoiceState], n: int) -> int:
    """Prompt tokens served from the prefix cache, over a response's prompts (choice index = prompt index * n + j)."""
    return sum(c.num_cached_tokens for c in choices[::n])


def add_token_ids(body: dict, choices: list[ChoiceState], chat: bool, final: bool, role_only: bool = False) -> None:
    """vLLM's return_token_ids: the prompt's token ids (at the top of a chat response, in each completions choice;
    a stream sends them once, first) and each choice's generated token ids (a stream chunk: its new ones).
    `choices`: those `body["choices"]` was built from, in order."""
    for choice, out in zip(choices, body["choices"]):
        if final or not choice.prompt_token_ids_sent:
            choice.prompt_token_ids_sent = True
            if chat:
                body["prompt_token_ids"] = choice.prompt_token_ids
            else:
                out["prompt_token_ids"] = choice.prompt_token_ids
        if not role_only:
            out["token_ids"] = choice.output_token_ids if final else choice.delta_output_token_ids


# A logprob of -inf (a token the request's mask excludes) has no JSON number: reported as vLLM does.
_MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top_entries(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The top-n alternatives of one position, most likely first."""
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num_top), key=lambda x: x[1].rank)
    return top[:num_top]


def _token(token_id: int, lp: Logprob, as_id: bool) -> str:
    """A logprob entry's token: its text, or with return_tokens_as_token_ids "token_id:N" (vLLM's form)."""
    return f"token_id:{token_id}" if as_id else lp.decoded_token or ""


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int, offset: int,
                        as_ids: bool = False) -> dict:  # fmt: skip
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset (of each token's text). An
    echoed prompt's first token has no logprob: its entry is a placeholder (prompt_scoring.first_token_entry),
    reported as nulls. as_ids: tokens named "token_id:N"."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        tokens.append(_token(token_id, sampled, as_ids))
        text_offset.append(offset)
        offset += len(sampled.decoded_token or "")
        if sampled.rank == 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_clamp(sampled.logprob))
        # the top `num_top` and the sampled token, wherever it ranks (up to num_top + 1 entries, as OpenAI's)
        top = {_token(t, lp, as_ids): _clamp(lp.logprob) for t, lp in _top_entries(entry, num_top)}
        top.setdefault(tokens[-1], _clamp(sampled.logprob))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int, as_ids: bool = False) -> dict:
    """OpenAI's chat shape: per token, the sampled token and its logprob, and top_logprobs: the `num_top` most likely
    (the sampled token among them only where it ranks). as_ids: tokens named "token_id:N"."""

    def item(token_id: int, lp: Logprob) -> dict:
        text = _token(token_id, lp, as_ids)
        return {"token": text, "logprob": _clamp(lp.logprob), "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(token_ids, entries):
        top = [item(t, lp) for t, lp in _top_entries(entry, num_top)]
        content.append({**item(token_id, entry[token_id]), "top_logprobs": top})
    return {"content": content}


def completion_chunk(request_id, created, model, choices: list[ChoiceState], final: bool, role_only=False) -> dict:
    out = []
    for c in choices:
        text, ids, entries = (
            (c.text, c.token_ids, c.logprobs) if final else (c.delta_text, c.delta_token_ids, c.delta_logprobs)
        )
        logprobs = None
        if c.want_logprobs:
            offset = 0 if final else len(c.text) - len(c.delta_text)
            logprobs = completion_logprobs(ids, entries, c.num_top, offset, c.ids_as_tokens)
        out.append(
            {
                "index": c.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": out}


def chat_chunk(request_id, created, model, choices: list[ChoiceState], final: bool = False, role_only=False,
               role: str = "assistant") -> dict:  # fmt: skip
    out = []
    for c in choices:
        if role_only:
            out.append(
                {
                    "index": c.index,
                    "delta": {"role": role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            continue
        text, ids, entries = (
            (c.text, c.token_ids, c.logprobs) if final else (c.delta_text, c.delta_token_ids, c.delta_logprobs)
        )
        logprobs = chat_logprobs(ids, entries, c.num_top, c.ids_as_tokens) if c.want_logprobs else None
        if final:
            out.append(
                {
                    "index": c.index,
                    "message": {"role": role, "content": text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        else:
            out.append(
                {
                    "index": c.index,
                    "delta": {"content": text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    obj = "chat.completion" if final else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": out}


def chat_echo_chunk(request_id, created, model, choice: ChoiceState, text: str) -> dict:
    """A chat stream's chunk of echoed text (the chat request's echo), before anything generated."""
    delta = {"index": choice.index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [delta]}


def sse(obj) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def absorb(choices: list[ChoiceState], prompt_index: int, n: int, out: RequestOutput) -> list[ChoiceState]:
    """Adds a request's output to its choices (choice index = prompt index * n + sample index) -> those touched."""
    touched = []
    if out.prompt_logprobs is not None:  # reported once per prompt, for all its choices
        for j in range(n):
            choices[prompt_index * n + j].prompt_logprobs = out.prompt_logprobs
    for j in range(n):
        choices[prompt_index * n + j].num_cached_tokens = out.num_cached_tokens
    for comp in out.outputs:
        choice = choices[prompt_index * n + comp.index]
        choice.add(comp, out.error)
        touched.append(choice)
    return touched


def error_type(status: int) -> str:
    """The OpenAI error type of a request the engine ended (Choice.error_status)."""
    return {400: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")


def error_events(message: str, status: int) -> bytes:
    """The last events of a stream that cannot finish: the error (vLLM's shape: the HTTP status as the code), then
    [DONE]."""
    error = error_body(message, error_type(status), code=status)
    return sse(error) + DONE
