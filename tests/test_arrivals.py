"""A burst of requests that wakes the idle server shares its first step (aserve/engine/intake_gate.py `settle`), and
every request's arrival is counted out again, whatever its handler did."""

import asyncio

import reliability_common
from reliability_common import MODEL, prompt_ids
from test_server import assert_idle

from aserve.engine import intake_gate
from aserve.entrypoints.openai.server_state import STATE_KEY

llm_engine, client = reliability_common.llm_engine, reliability_common.client  # fixtures, found by their names


def record_steps(llm_engine, monkeypatch) -> list[int]:
    """The number of requests in each step the engine schedules from now on."""
    sizes, schedule = [], llm_engine.core.schedule

    def recorded():
        work = schedule()
        if work is not None and work.sched is not None:
            sizes.append(len(work.sched.scheduled))
        return work

    monkeypatch.setattr(llm_engine.core, "schedule", recorded)
    return sizes


async def test_a_burst_shares_the_first_step(client, llm_engine, monkeypatch):
    # a generous quiet interval: the test client's requests reach the handlers whenever its loop turns come
    monkeypatch.setattr(intake_gate, "ARRIVALS_QUIET_S", 0.2)
    monkeypatch.setattr(intake_gate, "ARRIVALS_WAIT_S", 5.0)
    sizes = record_steps(llm_engine, monkeypatch)
    bodies = [{"model": MODEL, "prompt": prompt_ids(i), "max_tokens": 2, "ignore_eos": True} for i in range(6)]

    async def post(i: int, body: dict):  # a burst's requests a few milliseconds apart, as a client sends them
        await asyncio.sleep(0.01 * i)
        return await client.post("/v1/completions", json=body)

    resps = await asyncio.gather(*(post(i, body) for i, body in enumerate(bodies)))
    assert [r.status for r in resps] == [200] * 6
    assert [(await r.json())["usage"]["completion_tokens"] for r in resps] == [2] * 6
    assert sizes[0] == 6, sizes  # every prompt in the first step, not the first request alone
    assert client.app[STATE_KEY].engine._gate.arriving == 0
    assert_idle(llm_engine)


async def test_every_arrival_is_counted_out(client, llm_engine, monkeypatch):
    monkeypatch.setattr(intake_gate, "ARRIVALS_WAIT_S", 5.0)  # a request left counted would hold up every burst
    good = {"model": MODEL, "prompt": prompt_ids(1), "max_tokens": 2}
    requests = [
        client.post("/v1/completions", json=good),
        client.post("/v1/completions", json={**good, "stream": True}),
        client.post("/v1/completions", json={**good, "n": 2}),
        client.post("/v1/completions", json={**good, "prompt": [prompt_ids(2), prompt_ids(3)]}),
        client.post("/v1/completions", json={**good, "max_tokens": -1}),  # 400
        client.post("/v1/completions", data=b"{not json"),  # 400
        client.post("/v1/no/such/route", json=good),  # 404
        client.get("/v1/models"),
        client.post("/tokenize", json={"model": MODEL, "prompt": "hello"}),
    ]
    statuses = [r.status for r in await asyncio.gather(*requests)]
    assert statuses == [200, 200, 200, 200, 400, 400, 404, 200, 200]
    gate = client.app[STATE_KEY].engine._gate
    assert gate.arriving == 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    await gate.settle()
    assert loop.time() - start < 1.0
    assert_idle(llm_engine)
