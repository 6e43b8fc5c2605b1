"""One measured request, as recorded by the client; every statistic is computed from a list of these."""

from __future__ import annotations

import msgspec


class RequestRecord(msgspec.Struct, kw_only=True):
    """Times are seconds. `start` is since the run began; `ttft`, `e2e` and `chunk_times` are since `start`.
    Token counts are the server's usage when it reports one (loadgen always asks), else the workload's prompt length
    and the number of text chunks."""

    index: int  # send order within the run
    session: int  # conversation (== index for one-turn workloads)
    turn: int
    scheduled: float  # when the arrival process wanted it sent
    start: float  # when it was sent (later than scheduled while --max-concurrency holds it back)
    ttft: float | None  # first chunk carrying text; None when none came
    e2e: float  # to [DONE], the end of the stream, or the failure
    chunk_times: list[float]  # every chunk carrying text (so chunk_times[0] == ttft)
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    ok: bool
    error: str = ""
    status: int = 0  # HTTP status; 0 when no response came
    finish_reason: str | None = None
    usage_reported: bool = False
    generated_text: str = ""  # the streamed text, joined

    @property
    def end(self) -> float:
        return self.start + self.e2e

    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive text chunks (a chunk that carries several tokens counts once)."""
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]

    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (n_out - 1); None for fewer than two tokens."""
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)
