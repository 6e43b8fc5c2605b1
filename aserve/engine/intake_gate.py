"""IntakeGate: when the event loop's thread may take in new requests without holding up the step worker thread.

The worker runs Python between its waits for the device: a step's launch prepares the inputs and issues the kernels
(a prefill step's eager layers, hundreds of torch calls; a decode step's graph replay, tens), and every torch call
lets go of the GIL and takes it again. While the event loop's thread runs Python without a pause -- a burst of new
requests, each ~0.3 ms of parsing, validation and queuing -- each of those takes can wait up to the interpreter's
switch interval (5 ms): a launch of a few milliseconds stretches over the whole burst, and the device idles.
(2026-12-06, the 2-core VM: a torch.add on a 4-element tensor took 3.5 us per call alone, 0.4-2.7 ms beside a
thread running Python.)

So a request's intake waits while the worker launches a step (async scheduling: the step is queued on the device
and the call returns), and while a worker call's result waits for the step coroutine to take it up (the
coroutine's turn comes before more intake); it runs while the worker waits for the device, while it runs a whole
step (sync scheduling, where the wait for the device is most of the call), and while the engine idles. The step
coroutine closes the gate before a launch and opens it once it has resumed; the worker marks its result as waiting
(a plain attribute: all it touches from its own thread).
"""

from __future__ import annotations

import asyncio


class IntakeGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.worker_busy = False  # the worker runs a launch (or a whole step)
        self.result_waiting = False  # a worker call has returned; the step coroutine has not yet resumed
        self.retired = False  # the step coroutine has ended: nothing waits any more

    async def wait(self) -> None:
        """Returns when a request's intake may run."""
        while (self.worker_busy or self.result_waiting) and not self.retired:
            self._open.clear()  # (a waiting result is first seen here: the worker thread does not touch the event)
            await self._open.wait()

    def in_worker(self, fn, arg):
        """fn(arg), in the worker thread; marks its result as waiting for the step coroutine."""
        try:
            return fn(arg)
        finally:
            self.result_waiting = True

    def close(self) -> None:
        """Before a worker call that launches a step (and does not wait for the device)."""
        self.worker_busy = True
        self._open.clear()

    def resumed(self) -> None:
        """The step coroutine has taken up a worker call's result."""
        self.worker_busy = self.result_waiting = False

    def open(self) -> None:
        """The step coroutine has resumed, and the worker waits for the device, runs a whole step (sync
        scheduling), or idles: intake may run."""
        self.worker_busy = self.result_waiting = False
        self._open.set()

    def retire(self) -> None:
        """The step coroutine has ended: every intake goes ahead (and meets the engine's own error)."""
        self.retired = True
        self._open.set()
