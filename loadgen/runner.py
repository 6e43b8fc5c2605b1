"""Drives one load level: sends sessions on an open-loop schedule or from closed-loop users, within the request and
time bounds and the concurrency cap, and returns one RequestRecord per request sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import aiohttp
import numpy as np

from loadgen.arrivals import arrival_offsets
from loadgen.client import Outcome, Target, stream_request
from loadgen.config import Load
from loadgen.records import RequestRecord
from loadgen.workloads import RequestSpec, Session


class Bounds:
    """How much to send: at most `num_requests` requests, none starting after `duration` seconds."""

    def __init__(self, num_requests: int | None, duration: float | None) -> None:
        assert num_requests is not None or duration is not None, "an unbounded run never ends"
        self.num_requests, self.duration = num_requests, duration


class Runner:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        target: Target,
        *,
        max_concurrency: int | None = None,
        arrival: str = "poisson",
        burstiness: float = 1.0,
        request_timeout: float = 600.0,
        read_timeout: float = 120.0,
        on_done: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self.http, self.target = http, target
        self.max_concurrency = max_concurrency
        self.arrival, self.burstiness = arrival, burstiness
        self.request_timeout, self.read_timeout = request_timeout, read_timeout
        self.on_done = on_done

    async def run(
        self, load: Load, sessions: Iterator[Session], bounds: Bounds, rng: np.random.Generator, t0: float | None = None
    ) -> list[RequestRecord]:
        """Records in send order. `rng` draws the arrival gaps; `t0` (a perf_counter time) is the run's zero."""
        state = _RunState(bounds, time.perf_counter() if t0 is None else t0, self.max_concurrency)
        if load.mode == "rate":
            await self._open_loop(state, load.value, sessions, rng)
        else:
            users = [self._closed_loop_user(state, sessions) for _ in range(int(load.value))]
            await asyncio.gather(*users)
        return sorted(state.records, key=lambda r: r.index)

    async def _open_loop(self, state: _RunState, rate: float | None, sessions: Iterator[Session], rng) -> None:
        tasks = []
        try:
            for offset in arrival_offsets(self.arrival, rate, rng, self.burstiness):
                if state.duration_over(offset):
                    break
                session = state.take(sessions)
                if session is None:
                    break
                delay = state.t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._session(state, session, scheduled=offset)))
            await asyncio.gather(*tasks)
        finally:  # on cancellation (Ctrl-C), do not leave requests running
            for task in tasks:
                task.cancel()

    async def _closed_loop_user(self, state: _RunState, sessions: Iterator[Session]) -> None:
        while not state.duration_over(state.now()):
            session = state.take(sessions)
            if session is None:
                return
            await self._session(state, session, scheduled=state.now())

    async def _session(self, state: _RunState, session: Session, scheduled: float) -> None:
        session_id = state.new_session_id()
        history: list[dict] = []
        for turn, spec in enumerate(session.turns):
            if turn > 0:
                if state.duration_over(state.now()):
                    return
                scheduled = state.now()
            prompt = self._prompt(spec, history) if session.multi_turn else spec.prompt
            async with state.slots:
                record, outcome = await self._send(state, spec, prompt, session_id, turn, scheduled)
            state.records.append(record)
            if self.on_done is not None:
                self.on_done(record)
            if not record.ok:  # a conversation cannot go on without the reply
                return
            if session.multi_turn:
                history += [{"role": "user", "content": spec.prompt}, {"role": "assistant", "content": outcome.text}]

    def _prompt(self, spec: RequestSpec, history: list[dict]) -> str | list[dict]:
        """The history plus this turn: messages for the chat endpoint, a plain transcript for completions."""
        messages = history + [{"role": "user", "content": spec.prompt}]
        if self.target.endpoint == "chat":
            return messages
        lines = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nAssistant:"

    async def _send(
        self, state: _RunState, spec: RequestSpec, prompt, session_id: int, turn: int, scheduled: float
    ) -> tuple[RequestRecord, Outcome]:
        index = state.new_index()
        start = state.now()
        body = self.target.body(prompt, spec.max_tokens)
        outcome = await stream_request(self.http, self.target, body, self.request_timeout, self.read_timeout)
        record = RequestRecord(
            index=index,
            session=session_id,
            turn=turn,
            scheduled=scheduled,
            start=start,
            ttft=outcome.ttft,
            e2e=outcome.e2e,
            chunk_times=outcome.chunk_times,
            prompt_tokens=outcome.prompt_tokens if outcome.prompt_tokens is not None else spec.prompt_tokens,
            output_tokens=outcome.output_tokens if outcome.output_tokens is not None else len(outcome.chunk_times),
            max_tokens=spec.max_tokens,
            ok=outcome.ok,
            error=outcome.error,
            status=outcome.status,
            finish_reason=outcome.finish_reason,
            usage_reported=outcome.output_tokens is not None,
            generated_text=outcome.text,
        )
        return record, outcome


class _RunState:
    """Counters shared by the senders of one run."""

    def __init__(self, bounds: Bounds, t0: float, max_concurrency: int | None) -> None:
        self.bounds, self.t0 = bounds, t0
        self.reserved = 0  # requests promised to sessions taken so far
        self.records: list[RequestRecord] = []
        self.slots = asyncio.Semaphore(max_concurrency) if max_concurrency else _NoLimit()
        self._next_index = self._next_session = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def duration_over(self, t: float) -> bool:
        return self.bounds.duration is not None and t >= self.bounds.duration

    def take(self, sessions: Iterator[Session]) -> Session | None:
        """The next session, cut to the requests left under --num-requests; None when none are left."""
        left = None if self.bounds.num_requests is None else self.bounds.num_requests - self.reserved
        if left is not None and left <= 0:
            return None
        session = next(sessions)
        if left is not None and len(session.turns) > left:
            session = Session(session.turns[:left], session.multi_turn)
        self.reserved += len(session.turns)
        return session

    def new_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1

    def new_session_id(self) -> int:
        self._next_session += 1
        return self._next_session - 1


class _NoLimit:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc) -> None:
        return None
