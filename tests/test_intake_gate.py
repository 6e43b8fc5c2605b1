"""IntakeGate (aserve/engine/intake_gate.py): a request's intake waits while the device has finished the step the
worker waits for and while a worker call's result waits for the step coroutine; the coroutine's open() lets the
waiting intakes through."""

import asyncio
import threading

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
