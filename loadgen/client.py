"""The streaming OpenAI client: one request, every SSE chunk timestamped on arrival, every way of failing recorded
(HTTP errors, error events, early closes, malformed events, timeouts) rather than raised."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from loadgen.sse import SSEParser

_decode = msgspec.json.decode


class Target(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how requests go: base URL (http://host:port), model, endpoint and request options."""

    url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    temperature: float | None = 0.0  # None: not sent (the server's default applies)
    ignore_eos: bool = False
    extra_body: dict = msgspec.field(default_factory=dict)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def body(self, prompt: str | list[int] | list[dict], max_tokens: int) -> dict:
        """A streamed request; `prompt` is text or token ids (completions) or a message list (chat)."""
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = (
                prompt
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
                else [{"role": "user", "content": prompt}]
            )
        else:
            body["prompt"] = prompt
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.ignore_eos:  # a vLLM extension: exactly max_tokens tokens
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Outcome(msgspec.Struct, kw_only=True):
    """What one request observed. Times are seconds since it was sent."""

    ok: bool = False
    error: str = ""
    status: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    chunk_times: list[float] = msgspec.field(default_factory=list)
    text: str = ""  # the generated text (a chat turn's reply goes into the next turn's history)
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage
    finish_reason: str | None = None
    done: bool = False  # [DONE] seen


async def stream_request(
    http: aiohttp.ClientSession, target: Target, body: dict, total_timeout: float, read_timeout: float
) -> Outcome:
    """Sends one streamed request and never raises (except cancellation): failures are in the Outcome. The session
    should have no timeouts of its own; `read_timeout` bounds the silence between bytes (keep-alive comments count),
    `total_timeout` the whole exchange."""
    out = Outcome()
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_exchange(http, target, body, read_timeout, out, t0), total_timeout)
    except asyncio.TimeoutError as e:
        if isinstance(e, aiohttp.ServerTimeoutError):
            out.error = f"timed out: nothing from the server for {read_timeout:g} s"
        else:
            out.error = f"timed out: the request took over {total_timeout:g} s"
    except aiohttp.ClientPayloadError as e:  # e.g. the connection dropped inside a chunked body
        out.error = f"connection closed mid-stream ({e.__class__.__name__})"
    except aiohttp.ClientConnectorError as e:
        out.error = f"cannot connect to {target.url}: {e.os_error or e}"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        out.error = f"{e.__class__.__name__}: {e}"
    if out.error:
        out.ok = False
    out.e2e = time.perf_counter() - t0
    return out


async def _exchange(http, target: Target, body: dict, read_timeout: float, out: Outcome, t0: float) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=read_timeout, sock_read=read_timeout)
    async with http.post(target.url + target.path, json=body, headers=target.headers(), timeout=timeout) as resp:
        out.status = resp.status
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {_error_message(await resp.read())}"
            return
        content_type = resp.headers.get("Content-Type", "")
        if not content_type.startswith("text/event-stream"):
            out.error = f"expected an event stream (text/event-stream), got {content_type or 'no content type'}"
            return
        parser = SSEParser()
        pieces: list[str] = []
        async for chunk in resp.content.iter_any():
            now = time.perf_counter() - t0
            if _absorb(parser.feed(chunk), now, out, pieces):
                break
        else:
            _absorb(parser.close(), time.perf_counter() - t0, out, pieces)
        out.text = "".join(pieces)
        if out.error:
            return
        if not out.done and out.finish_reason is None:
            out.error = "connection closed before the stream finished"
            return
        out.ok = True


def _absorb(events: list[str], now: float, out: Outcome, pieces: list[str]) -> bool:
    """Applies events received at `now`; True when the stream is over ([DONE] or an error)."""
    for data in events:
        if data.strip() == "[DONE]":
            out.done = True
            return True
        try:
            obj = _decode(data)
        except msgspec.DecodeError:
            out.error = f"malformed event: {data[:80]!r}"
            return True
        if not isinstance(obj, dict):
            out.error = f"malformed event: {data[:80]!r}"
            return True
        if obj.get("error"):
            out.error = f"error event: {_message_of(obj['error'])}"
            return True
        text = ""
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            # completions: text; chat: content (and reasoning models' reasoning_content)
            text += choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
        if text:
            if out.ttft is None:
                out.ttft = now
            out.chunk_times.append(now)
            pieces.append(text)
        usage = obj.get("usage")
        if usage:
            out.prompt_tokens = usage.get("prompt_tokens")
            out.output_tokens = usage.get("completion_tokens")
    return False


def _message_of(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _error_message(body: bytes) -> str:
    try:
        obj = _decode(body)
    except msgspec.DecodeError:
        return body[:200].decode("utf-8", errors="replace").strip() or "(empty body)"
    if isinstance(obj, dict) and "error" in obj:
        return _message_of(obj["error"])
    if isinstance(obj, dict) and "message" in obj:
        return str(obj["message"])
    return str(obj)[:200]
