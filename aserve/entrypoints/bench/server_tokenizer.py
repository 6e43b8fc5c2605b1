"""The server's tokenizer, through its /tokenize and /detokenize (vLLM's routes, aserve's too): `aserve bench serve`
makes and counts its prompts with the tokenizer that will read them, wherever the server runs."""

from __future__ import annotations

import asyncio

import aiohttp

from aserve.entrypoints.bench.errors import BenchmarkError


class ServerTokenizer:
    def __init__(
        self, http: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str, max_in_flight: int = 32
    ) -> None:
        self.http, self.url, self.headers, self.model = http, url, headers, model
        self._slots = asyncio.Semaphore(max_in_flight)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = await self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})
        return body["tokens"]

    async def render(self, user_message: str) -> list[int]:
        """The tokens of a one-message chat as the chat endpoint renders it (the template, the generation prompt)."""
        body = await self._post("/tokenize", {"messages": [{"role": "user", "content": user_message}]})
        return body["tokens"]

    async def decode(self, token_ids: list[int]) -> str:
        return (await self._post("/detokenize", {"tokens": token_ids}))["prompt"]

    async def _post(self, path: str, body: dict) -> dict:
        async with self._slots:
            try:
                async with self.http.post(
                    self.url + path,
                    json={"model": self.model, **body},
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=120),
                ) as resp:
                    if resp.status != 200:
                        text = (await resp.text())[:300]
                        raise BenchmarkError(f"{self.url}{path} answered HTTP {resp.status}: {text}")
                    return await resp.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise BenchmarkError(f"{self.url}{path}: {e.__class__.__name__}: {e}; is the server up?") from None
