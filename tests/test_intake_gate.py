"""IntakeGate (aserve/engine/intake_gate.py): a request's intake waits while the device has finished the step the
worker waits for and while a worker call's result waits for the step coroutine; the coroutine's open() lets the
waiting intakes through."""

import asyncio
import threading

from aserve.engine import intake_gate
from aserve.engine.intake_gate import IntakeGate


async def passes(gate: IntakeGate) -> bool:
    """Does an intake get through the gate within a few loop turns?"""
    task = asyncio.ensure_future(gate.wait())
    for _ in range(5):
        await asyncio.sleep(0)
    if task.done():
        return True
    task.cancel()
    return False


async def test_intake_waits_for_a_finished_device_step_and_a_waiting_result():
    device = {"done": False}
    gate = IntakeGate(lambda: device["done"])
    assert await passes(gate)  # the device computes (or the engine idles)
    device["done"] = True  # the worker is about to hand over the step's result
    waiting = asyncio.ensure_future(gate.wait())
    await asyncio.sleep(0)
    assert not waiting.done() and not await passes(gate)
    worker = threading.Thread(target=gate.in_worker, args=(lambda: None,))  # the worker's call returns
    worker.start()
    worker.join()
    device["done"] = False  # the step coroutine takes the result up and launches the next step
    assert gate.result_waiting and not await passes(gate)
    gate.open()
    await asyncio.wait_for(waiting, 1)
    assert await passes(gate)


async def test_a_retired_gate_lets_every_intake_through():
    gate = IntakeGate(lambda: True)
    waiting = asyncio.ensure_future(gate.wait())
    await asyncio.sleep(0)
    gate.retire()
    await asyncio.wait_for(waiting, 1)
    gate.result_waiting = True  # a worker call that returned after the step coroutine had ended
    assert await passes(gate)


async def test_settle_waits_for_the_requests_arriving_and_a_quiet_interval(monkeypatch):
    monkeypatch.setattr(intake_gate, "ARRIVALS_QUIET_S", 0.01)
    monkeypatch.setattr(intake_gate, "ARRIVALS_WAIT_S", 5.0)
    gate = IntakeGate(lambda: False)
    loop = asyncio.get_running_loop()

    async def arrival(delay: float, handled: float) -> None:  # a handler: its intake turn, then the engine
        await asyncio.sleep(delay)
        gate.arrival_began()
        await asyncio.sleep(handled)
        gate.arrival_ended()
        gate.arrival_ended()  # (a second call, e.g. the server's after its handler returned, does nothing)

    first = asyncio.ensure_future(arrival(0, 0))
    await first
    start = loop.time()
    rest = [asyncio.ensure_future(arrival(0.004 * i, 0.05)) for i in range(1, 4)]
    await gate.settle()  # the three others begin 4 ms apart, and each takes 50 ms to reach the engine
    assert loop.time() - start >= 0.05 + 0.012 - 0.005 and gate.arriving == 0
    await asyncio.gather(*rest)


async def test_settle_waits_at_most_arrivals_wait_s(monkeypatch):
    monkeypatch.setattr(intake_gate, "ARRIVALS_WAIT_S", 0.03)
    gate = IntakeGate(lambda: False)
    gate.arrival_began()  # a request whose handler never gets to the engine in time (a slow body, say)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await gate.settle()
    assert 0.03 <= loop.time() - start < 1.0 and gate.arriving == 1
    gate.arrival_ended()
    assert gate.arriving == 0


async def test_a_lone_request_waits_the_quiet_interval_from_its_turn(monkeypatch):
    monkeypatch.setattr(intake_gate, "ARRIVALS_QUIET_S", 0.02)
    gate = IntakeGate(lambda: False)
    loop = asyncio.get_running_loop()
    gate.arrival_began()
    began = loop.time()
    gate.arrival_ended()
    await gate.settle()
    assert 0.02 <= loop.time() - began < 0.5
    start = loop.time()
    await gate.settle()  # quiet for long enough already: at once
    assert loop.time() - start < 0.01
