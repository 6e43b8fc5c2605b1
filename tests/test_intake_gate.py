"""IntakeGate (aserve/engine/intake_gate.py): a request's intake waits while the step worker launches and while a
worker call's result waits for the step coroutine; the coroutine's open() lets the waiting intakes through."""

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


async def test_intake_waits_for_the_launch_and_for_a_waiting_result():
    gate = IntakeGate()
    assert await passes(gate)  # idle
    gate.close()
    waiting = asyncio.ensure_future(gate.wait())
    await asyncio.sleep(0)
    assert not waiting.done() and not await passes(gate)
    # the launch returns in the worker thread: its result waits for the step coroutine
    thread = threading.Thread(target=gate.in_worker, args=(lambda arg: arg, None))
    thread.start()
    thread.join()
    gate.open()  # the coroutine resumed and the device runs: the waiting intake goes through
    await asyncio.wait_for(waiting, 1)
    thread = threading.Thread(target=gate.in_worker, args=(lambda arg: arg, None))  # the device step ends
    thread.start()
    thread.join()
    assert gate.result_waiting and not await passes(gate)
    gate.resumed()
    assert await passes(gate)


async def test_a_retired_gate_lets_every_intake_through():
    gate = IntakeGate()
    gate.close()
    waiting = asyncio.ensure_future(gate.wait())
    await asyncio.sleep(0)
    gate.retire()
    await asyncio.wait_for(waiting, 1)
    gate.result_waiting = True  # a worker call that returned after the step coroutine had ended
    assert await passes(gate)
