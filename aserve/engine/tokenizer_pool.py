"""Tokenising, detokenising and chat-template rendering for the server, off the event loop.

Short texts are tokenised inline (a thread hop would cost more than the work). Longer ones, and every chat
rendering, run in a fixed pool of threads (the tokenizer releases the GIL while it encodes, and a Jinja template
yields it every switch interval), so /health and every stream keep answering meanwhile. At most `max_pending_chars`
characters of text may be queued or in work in the pool at once: tokenising holds ~350 bytes per token until it
ends, and without a cap a burst of long prompts (each of which fits the context on its own) adds up to gigabytes.
Beyond the cap a request gets EngineOverloadedError (HTTP 429, Retry-After) before any of its text is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from aserve.engine.errors import EngineOverloadedError
from aserve.sampling_params import ParamError

INLINE_CHARS = 4096  # texts (and token lists) up to this long are handled on the event loop: ~1-3 ms of work
DEFAULT_POOL_SIZE = 2
DEFAULT_MAX_PENDING_CHARS = 16 * 2**20


class TokenizerPool:
    def __init__(
        self,
        tokenizer,
        pool_size: int = DEFAULT_POOL_SIZE,
        max_pending_chars: int = DEFAULT_MAX_PENDING_CHARS,
        max_text_chars: int = 0,
    ) -> None:
        """max_text_chars: the longest text a request may bring (longer ones are refused before they get here); the
        cap is raised to it, so that every admissible text fits when the pool is idle."""
        if pool_size < 1:
            raise ValueError(f"the tokenizer pool needs at least one thread, got {pool_size}")
        self.tokenizer = tokenizer
        self.max_pending_chars = max(max_pending_chars, max_text_chars)
        self.pending_chars = 0
        self._executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="aserve-tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encode = self.tokenizer.encode
        if len(text) <= INLINE_CHARS:
            return encode(text, add_special_tokens=add_special_tokens)
        return await self._run(len(text), lambda: encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        decode = self.tokenizer.decode
        if len(token_ids) <= INLINE_CHARS:
            return decode(token_ids)
        return await self._run(len(token_ids), lambda: decode(token_ids))

    async def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        text_chars: int,
        check_chars: Callable[[int], None],
    ) -> list[int]:
        """A conversation through the tokenizer's chat template -> its token ids, both in the pool. The messages'
        text (`text_chars` characters) counts against the cap; `check_chars(len(rendered))` may refuse the rendered
        text before it is tokenised."""
        tokenizer = self.tokenizer
        if tokenizer.chat_template is None:
            raise ParamError("messages", "this model's tokenizer has no chat template; use /v1/completions")

        def render() -> list[int]:
            try:
                text = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=False, **(template_kwargs or {})
                )
            except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
                raise ParamError("messages", f"the chat template rejected the messages: {e}") from e
            check_chars(len(text))
            return tokenizer.encode(text, add_special_tokens=False)

        return await self._run(text_chars, render)

    async def _run(self, num_chars: int, fn):
        if self.pending_chars and self.pending_chars + num_chars > self.max_pending_chars:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.pending_chars} characters of prompt text are being tokenised "
                f"(limit {self.max_pending_chars}); retry later",
                retry_after=1,
                code="tokenizer_busy",
            )
        # Counted until the thread is done with it, not until its caller stops waiting: a client that hangs up does
        # not stop a running tokenisation.
        self.pending_chars += num_chars
        loop = asyncio.get_running_loop()
        future = self._executor.submit(fn)
        future.add_done_callback(lambda _: _call_soon(loop, self._release, num_chars))
        return await asyncio.wrap_future(future, loop=loop)

    def _release(self, num_chars: int) -> None:
        self.pending_chars -= num_chars

    def shutdown(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody counts any more
        loop.call_soon_threadsafe(fn, *args)
