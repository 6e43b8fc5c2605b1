"""IntakeGate: when the event loop's thread may take in new requests without holding up the step worker thread.

The worker needs the GIL to launch a step (input preparation, graph replays, a prefill step's eager layers: tens to
hundreds of torch calls, each of which lets go of the GIL and takes it again) and to hand over a step's result once
the device has finished it. The event loop's thread, taking in a burst of requests (each ~0.3 ms of parsing,
validation and queuing, among socket reads and writes), holds the GIL nearly all the time and lets go of it only
for moments, at each system call: a thread waiting for the GIL is woken at each of those moments and finds it taken
again, and may wait out the whole burst. (2026-12-06, the 2-core VM: a thread woken through a queue while another
ran Python in 0.3 ms pieces took the GIL after 5.3 ms at the median -- the interpreter's switch interval -- and after
251 ms at the median, 922 ms at most, when each piece also made a system call.)

So on a GPU the step coroutine launches with the event loop's thread waiting (AsyncEngine._step_loop: the launch has
the GIL to itself, a few milliseconds), and a request's intake waits here while the device has finished the step the
worker waits for and while a worker call's result waits for the step coroutine (the step loop never idles with a
step in flight, so the first cannot hold intake for long): the loop's thread then idles, the worker takes the GIL,
and the step coroutine's turn comes before more intake. Intake runs while the device computes and while the engine
idles. The worker marks its result as waiting (a plain attribute: all it touches from its own thread); the step
coroutine opens the gate when it resumes.

The gate also counts the requests arriving: from their intake turn until they are in the engine (or their handler
has returned without adding one). Before a step that would start a batch afresh (nothing running, no step in
flight), the step coroutine lets the rest of a burst in (`settle`: until none is arriving and none has begun for
ARRIVALS_QUIET_S, for at most ARRIVALS_WAIT_S; on the 2-core VM a burst's requests reached the handlers 0.3-2 ms
apart), so that a burst's prompts share its first steps as they would offline rather than trickle in one or two a
step: every step that computes prompts holds up the requests already decoding, and a burst spread over more steps
holds them up more often (2026-12-07, H100, 64 streams: the first wave's 64 prompts spread over 6 steps against
offline's 4, and the spread carried on into the later waves of the closed-loop client; the CPU, 8 streams: the p99
gap between a stream's tokens 115-159 ms with it against 455-466 without). A request arriving at an engine with
nothing running waits ARRIVALS_QUIET_S from its intake turn.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable

ARRIVALS_QUIET_S = 0.003  # a burst has ended when no request's intake has begun for this long
ARRIVALS_WAIT_S = 0.02  # the longest a step that starts a batch afresh waits for a burst

# The arrival of the request whose handler runs in this context: [counted], shared with the tasks it starts
_ARRIVAL: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("aserve_arrival", default=None)


class IntakeGate:
    def __init__(self, device_done: Callable[[], bool]) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.device_done = device_done  # has the device finished the step the worker waits for?
        self.result_waiting = False  # a worker call has returned; the step coroutine has not yet resumed
        self.retired = False  # the step coroutine has ended: nothing waits any more
        self.arriving = 0  # requests past their intake turn and not yet in the engine
        self.last_arrival = 0.0  # when the last one's intake turn came (the loop's clock)

    async def wait(self) -> None:
        """Returns when a request's intake may run."""
        while (self.result_waiting or self.device_done()) and not self.retired:
            self._open.clear()  # (the worker's states are first seen here: the worker thread does not touch the event)
            await self._open.wait()

    def arrival_began(self) -> None:
        """A request's intake begins (in its handler's context)."""
        self.arriving += 1
        self.last_arrival = asyncio.get_running_loop().time()
        _ARRIVAL.set([True])

    def arrival_ended(self) -> None:
        """The request of this context is in the engine, or its handler is done (once; later calls do nothing)."""
        arrival = _ARRIVAL.get()
        if arrival is not None and arrival[0]:
            arrival[0] = False
            self.arriving -= 1

    async def settle(self) -> None:
        """Returns once no request is arriving and none has arrived for ARRIVALS_QUIET_S, or after ARRIVALS_WAIT_S."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        end = now + ARRIVALS_WAIT_S
        while (self.arriving > 0 or now - self.last_arrival < ARRIVALS_QUIET_S) and now < end:
            await asyncio.sleep(0.0002)
            now = loop.time()

    def in_worker(self, fn, *args):
        """fn(*args), in the worker thread; marks its result as waiting for the step coroutine."""
        try:
            return fn(*args)
        finally:
            self.result_waiting = True

    def open(self) -> None:
        """The step coroutine has resumed with a worker call's result."""
        self.result_waiting = False
        self._open.set()

    def retire(self) -> None:
        """The step coroutine has ended: every intake goes ahead (and meets the engine's own error)."""
        self.retired = True
        self._open.set()
