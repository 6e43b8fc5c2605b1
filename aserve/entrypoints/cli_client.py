"""`aserve chat` and `aserve complete`: vLLM's command-line clients of a running server (OpenAI API, streamed).

    aserve chat [--url http://localhost:8000/v1] [--model-name M] [--system-prompt S] [-q MESSAGE]
    aserve complete [--url ...] [--model-name M] [-q PROMPT]

Without -q each line read from standard input is a turn (chat keeps the conversation) until end of input. The model is
the server's first one unless --model-name names another; the API key comes from --api-key or OPENAI_API_KEY."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://localhost:8000/v1"


def add_client_parsers(sub) -> None:
    for name, what in (("chat", "chat with a running server, turn by turn"),
                       ("complete", "complete prompts with a running server")):  # fmt: skip
        p = sub.add_parser(name, help=what)
        p.add_argument("--url", default=DEFAULT_URL, help="the server's OpenAI API base URL")
        p.add_argument("--model-name", default=None, help="the model to ask (default: the server's first)")
        p.add_argument("--api-key", default=None, help="the server's API key (default: $OPENAI_API_KEY)")
        p.add_argument("--max-tokens", type=int, default=None, help="per reply (default: the server's)")
        p.add_argument("-q", "--quick", default=None, help="send this one message / prompt, print the reply, exit")
        if name == "chat":
            p.add_argument("--system-prompt", default=None, help="a system message before the conversation")


def run_client(ns: argparse.Namespace) -> None:
    client = _Client(ns.url.rstrip("/"), ns.api_key or os.environ.get("OPENAI_API_KEY"))
    model = ns.model_name or client.first_model()
    messages = [{"role": "system", "content": ns.system_prompt}] if getattr(ns, "system_prompt", None) else []
    lines = [ns.quick] if ns.quick is not None else _stdin_lines()
    for line in lines:
        body = {"model": model, "stream": True}
        if ns.max_tokens is not None:
            body["max_tokens"] = ns.max_tokens
        if ns.command == "chat":
            messages.append({"role": "user", "content": line})
            reply = client.stream("/chat/completions", {**body, "messages": messages},
                                  lambda choice: choice.get("delta", {}).get("content"))  # fmt: skip
            messages.append({"role": "assistant", "content": reply})
        else:
            client.stream("/completions", {**body, "prompt": line}, lambda choice: choice.get("text"))


def _stdin_lines():
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line.rstrip("\n")


class _Client:
    def __init__(self, base: str, api_key: str | None) -> None:
        self.base = base
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise ValueError(f"{self.base + path}: HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise ValueError(f"cannot reach {self.base}: {e.reason}") from None

    def first_model(self) -> str:
        with self._open("/models") as resp:
            return json.load(resp)["data"][0]["id"]

    def stream(self, path: str, body: dict, text_of) -> str:
        """Prints the streamed reply as it arrives (and a newline); returns it."""
        pieces = []
        with self._open(path, body) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise ValueError(f"the server ended the reply: {event['error'].get('message')}")
                for choice in event.get("choices", []):
                    if piece := text_of(choice):
                        pieces.append(piece)
                        print(piece, end="", flush=True)
        print(flush=True)
        return "".join(pieces)
