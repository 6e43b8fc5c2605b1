"""A deterministic fake OpenAI-compatible server on raw asyncio sockets, for loadgen's tests and for trying loadgen
without a model. Raw sockets, not aiohttp, so that it can misbehave the way real servers and proxies do.

Replies stream `max_tokens` tokens ("tok0 ", "tok1 ", ...). A directive in the prompt (or the last chat message)
picks a misbehaviour:
  #split      every event is written in 5-byte pieces (one reply token is "é", split inside its UTF-8 bytes)
  #keepalive  ": keep-alive" comment lines between events
  #error      an error event after two tokens (then [DONE], as vLLM does)
  #close      the connection is closed after two tokens
  #hang       one token, then silence
  #stall      headers, then silence
  #http500    an HTTP 500 with an OpenAI error body
  #garbage    an event whose data is not JSON
  #nousage    no usage event even when asked for one
GET /metrics exports `aserve:` counters that grow by known amounts per reply (see `_metrics`)."""

from __future__ import annotations

import argparse
import asyncio
import json

PIECE = 5  # bytes per write under #split


class FakeServer:
    def __init__(
        self,
        *,
        model: str = "fake-model",
        token_delay: float = 0.0,
        first_token_delay: float = 0.0,
        chunked: bool = False,
    ) -> None:
        self.model, self.chunked = model, chunked
        self.token_delay, self.first_token_delay = token_delay, first_token_delay
        self.requests: list[tuple[str, str, dict | None]] = []  # (method, path, JSON body)
        self.in_flight = self.max_in_flight = 0
        self.replies = self.prompt_tokens = self.generation_tokens = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def __aenter__(self) -> FakeServer:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- HTTP ---------------------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            body = json.loads(raw) if raw else None
            self.requests.append((method, path, body))
            await self._route(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:  # close() while a reply hangs: end quietly (asyncio would log a cancelled
            pass  # connection task as an error)
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _respond(self, writer, status: int, payload: dict | str, content_type="application/json") -> None:
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    async def _route(self, method: str, path: str, body: dict | None, writer) -> None:
        if method == "GET" and path == "/v1/models":
            await self._respond(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        elif method == "GET" and path == "/metrics":
            await self._respond(writer, 200, self._metrics(), "text/plain; version=0.0.4")
        elif method == "POST" and path == "/tokenize":
            words = len(body["prompt"].split())
            await self._respond(writer, 200, {"count": 2 * words + 1, "tokens": list(range(2 * words + 1))})
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await self._generate(body, path == "/v1/chat/completions", writer)
            finally:
                self.in_flight -= 1
        else:
            await self._respond(writer, 404, {"error": {"message": f"no route {method} {path}"}})

    async def _write(self, writer, data: bytes, split: bool) -> None:
        pieces = [data[i : i + PIECE] for i in range(0, len(data), PIECE)] if split else [data]
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(0.001)  # separate TCP segments
            writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if self.chunked else piece)
            await writer.drain()

    # -- generation ---------------------------------------------------------------------------------------------

    async def _generate(self, body: dict, chat: bool, writer) -> None:
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        text = prompt if isinstance(prompt, str) else ""
        directive = next(
            (
                d
                for d in (
                    "#split",
                    "#keepalive",
                    "#error",
                    "#close",
                    "#hang",
                    "#stall",
                    "#http500",
                    "#garbage",
                    "#nousage",
                )
                if d in text
            ),
            "",
        )
        if directive == "#http500":
            await self._respond(writer, 500, {"error": {"message": "the engine fell over", "type": "server_error"}})
            return
        framing = "Transfer-Encoding: chunked" if self.chunked else "Connection: close"
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{framing}\r\n\r\n".encode())
        await writer.drain()
        if directive == "#stall":
            await asyncio.sleep(3600)
        split = directive == "#split"
        n = int(body.get("max_tokens") or 16)
        if chat:
            await self._write(
                writer, _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), split
            )
        await asyncio.sleep(self.first_token_delay)
        for i in range(n):
            if i and self.token_delay:
                await asyncio.sleep(self.token_delay)
            if directive == "#keepalive":
                await self._write(writer, b": keep-alive\n\n", split)
            if directive in ("#error", "#close") and i == 2:
                if directive == "#close":
                    return  # _handle closes the socket mid-stream
                await self._write(writer, _sse({"error": {"message": "out of memory", "type": "server_error"}}), split)
                await self._write(writer, b"data: [DONE]\n\n", split)
                return self._end_chunked(writer)
            if directive == "#garbage" and i == 1:
                await self._write(writer, b"data: {not json\n\n", split)
            token = "\u00e9" if split and i == 1 else f"tok{i} "
            finish = "length" if i == n - 1 else None
            choice = {"index": 0, "delta": {"content": token}} if chat else {"index": 0, "text": token}
            await self._write(writer, _sse({"choices": [{**choice, "finish_reason": finish}]}), split)
            if directive == "#hang":
                await asyncio.sleep(3600)
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(text.split())
        self.replies += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += n
        if (body.get("stream_options") or {}).get("include_usage") and directive != "#nousage":
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            await self._write(writer, _sse({"choices": [], "usage": usage}), split)
        await self._write(writer, b"data: [DONE]\n\n", split)
        self._end_chunked(writer)

    def _end_chunked(self, writer) -> None:
        if self.chunked:
            writer.write(b"0\r\n\r\n")

    def _metrics(self) -> str:
        """Per finished reply: 1 preemption; prompt and generated tokens; prefix-cache queries = prompt tokens, hits =
        half of them (rounded down overall); a TTFT of first_token_delay. KV usage is always 0.25. A second model's
        series (which loadgen must ignore) carries large numbers."""
        lines = []
        for model, scale in ((self.model, 1), ("other-model", 1000)):
            label = f'model_name="{model}"'
            lines += [
                f"aserve:num_preemptions_total{{{label}}} {scale * self.replies}",
                f"aserve:prompt_tokens_total{{{label}}} {scale * self.prompt_tokens}",
                f"aserve:generation_tokens_total{{{label}}} {scale * self.generation_tokens}",
                f"aserve:prefix_cache_queries_total{{{label}}} {scale * self.prompt_tokens}",
                f"aserve:prefix_cache_hits_total{{{label}}} {scale * (self.prompt_tokens // 2)}",
                f'aserve:request_success_total{{finished_reason="length",{label}}} {scale * self.replies}',
                f"aserve:kv_cache_usage_perc{{{label}}} {0.25 * scale}",
                f"aserve:num_requests_running{{{label}}} {self.in_flight if scale == 1 else 99}",
                f"aserve:num_requests_waiting{{{label}}} 0.0",
                f"aserve:time_to_first_token_seconds_sum{{{label}}} {scale * self.replies * self.first_token_delay}",
                f"aserve:time_to_first_token_seconds_count{{{label}}} {scale * self.replies}",
            ]
        return (
            "# HELP aserve:num_preemptions_total Preemptions.\n# TYPE aserve:num_preemptions_total counter\n"
            + "\n".join(lines)
            + "\n"
        )


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _serve(port: int, token_delay: float, first_token_delay: float) -> None:
    server = await FakeServer(token_delay=token_delay, first_token_delay=first_token_delay).start(port)
    print(f"fake OpenAI server at {server.url} (Ctrl-C to stop)", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":  # python -m loadgen.fake_server --port 8000
    parser = argparse.ArgumentParser(prog="python -m loadgen.fake_server", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-delay", type=float, default=0.02, help="seconds between tokens")
    parser.add_argument("--first-token-delay", type=float, default=0.05, help="seconds before the first token")
    ns = parser.parse_args()
    try:
        asyncio.run(_serve(ns.port, ns.token_delay, ns.first_token_delay))
    except KeyboardInterrupt:
        pass
