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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class IntakeGate:
    def __init__(self, device_done: Callable[[], bool]) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.device_done = device_done  # has the device finished the step the worker waits for?
        self.result_waiting = False  # a worker call has returned; the step coroutine has not yet resumed
        self.retired = False  # the step coroutine has ended: nothing waits any more

    async def wait(self) -> None:
        """Returns when a request's intake may run."""
        while (self.result_waiting or self.device_done()) and not self.retired:
            self._open.clear()  # (the worker's states are first seen here: the worker thread does not touch the event)
            await self._open.wait()

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
