"""AsyncEngine: streamed outputs (deltas, cumulative, final only), concurrent requests, aborts, failed steps, a free
event loop."""

import asyncio
import random
import time

import pytest

from aserve import LLM, AsyncEngine, EngineArgs, SamplingParams
from aserve.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA


def prompt(n, seed=0):
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]}


@pytest.fixture(params=[False, True], ids=["sync", "async-scheduling"])
def engine(tiny_model, request):
    """Both step loops: one step at a time, and async scheduling (step N+1 launched before step N is processed; the
    default on CUDA)."""
    return AsyncEngine.from_engine_args(
        EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_num_batched_tokens=32,
                   debug_invariants=True, async_scheduling=request.param)
    )  # fmt: skip


async def collect(engine, p, params, request_id):
    chunks = []
    async for out in engine.generate(p, params, request_id):
        chunks.append(out)
    return chunks


def assert_all_blocks_free(llm_engine):
    assert llm_engine.core.kv_manager.pool.num_free_blocks == llm_engine.core.num_kv_blocks
    assert (
        not llm_engine.core.kv_manager.req_to_blocks
        and not llm_engine.core.scheduler.has_unfinished()
        and not llm_engine.output_processor.states
    )


async def test_streamed_deltas_equal_offline_output(engine, tiny_model):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=DELTA)
    prompts = [prompt(n, seed=n) for n in (5, 40, 70)]
    results = await asyncio.gather(*(collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))
    offline = LLM(tiny_model, dtype="float32", enforce_eager=True).generate(prompts, params)
    for chunks, ref in zip(results, offline):
        assert len(chunks) > 1 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        tokens = [t for c in chunks for t in c.outputs[0].token_ids]
        text = "".join(c.outputs[0].text for c in chunks)
        assert tokens == ref.outputs[0].token_ids and text == ref.outputs[0].text
        assert chunks[-1].outputs[0].finish_reason == "length"
    assert_all_blocks_free(engine.engine)
    await engine.shutdown()


async def test_output_kind_cumulative_delta_final_only(engine):
    """vLLM's RequestOutputKind: CUMULATIVE (the default) gives the whole output so far each time, the last one the
    final text; DELTA's pieces join to it (the prompt's logprobs in the first only); FINAL_ONLY gives that one output
    alone."""
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cumulative = await collect(engine, prompt(9), base, "cumulative")
    final = cumulative[-1].outputs[0]
    assert len(cumulative) > 1 and final.finish_reason == "length" and len(final.token_ids) == 12
    for before, after in zip(cumulative, cumulative[1:]):
        a, b = before.outputs[0], after.outputs[0]
        assert b.text.startswith(a.text) and b.token_ids[: len(a.token_ids)] == a.token_ids
        assert len(b.token_ids) > len(a.token_ids)
    deltas = await collect(engine, prompt(9), base.clone(output_kind=DELTA, prompt_logprobs=1), "delta")
    assert "".join(c.outputs[0].text for c in deltas) == final.text
    assert [t for c in deltas for t in c.outputs[0].token_ids] == final.token_ids
    # a stream of deltas carries the prompt's logprobs once, with its first output (as vLLM's)
    sent = [c.prompt_logprobs for c in deltas]
    assert len(sent) > 2 and len(sent[0]) == 9 and sent[0][0] is None and all(p is None for p in sent[1:])
    only = await collect(engine, prompt(9), base.clone(output_kind=RequestOutputKind.FINAL_ONLY), "final")
    assert len(only) == 1 and only[0].finished
    assert (only[0].outputs[0].text, only[0].outputs[0].token_ids) == (final.text, final.token_ids)
    await engine.shutdown()


async def test_n2_stream_reports_each_index(engine):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, output_kind=DELTA)
    chunks = await collect(engine, prompt(10), params, "n2")
    per_index = {0: [], 1: []}
    finishes = {}
    for c in chunks:
        for comp in c.outputs:
            per_index[comp.index] += comp.token_ids
            if comp.finish_reason:
                assert comp.index not in finishes
                finishes[comp.index] = comp.finish_reason
    assert all(len(v) <= 8 and v for v in per_index.values()) and set(finishes) == {0, 1}
    await engine.shutdown()


async def test_client_going_away_aborts_and_frees_blocks(engine):
    gen = engine.generate(prompt(50), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "leaver")
    received = 0
    async for _ in gen:
        received += 1
        if received == 3:
            break
    await gen.aclose()
    assert_all_blocks_free(engine.engine)
    assert engine.engine.stats.finished_total["abort"] == 1
    # The engine keeps serving.
    chunks = await collect(engine, prompt(8), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "next")
    assert chunks[-1].finished
    await engine.shutdown()


async def test_cancelled_handler_task_aborts(engine):
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(prompt(30), SamplingParams(max_tokens=500, ignore_eos=True), "cancel-me"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_all_blocks_free(engine.engine)
    await engine.shutdown()


async def test_bad_input_raises_and_engine_keeps_serving(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        async for _ in engine.generate({"prompt_token_ids": [3] * 10_000}, SamplingParams(), "too-long"):
            pass
    with pytest.raises(ValueError, match="out of range"):
        async for _ in engine.generate({"prompt_token_ids": [1, 999_999]}, SamplingParams(), "bad-id"):
            pass
    with pytest.raises(ValueError, match="empty"):
        async for _ in engine.generate("", SamplingParams(), "empty"):
            pass
    chunks = await collect(engine, "Hello world", SamplingParams(max_tokens=3, ignore_eos=True), "ok")
    assert chunks[-1].finished
    assert_all_blocks_free(engine.engine)
    await engine.shutdown()


async def test_failed_step_ends_its_requests_only(engine, monkeypatch):
    llm_engine = engine.engine
    real_launch = llm_engine.core.runner.launch
    calls = {"n": 0}

    def flaky(sched, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real_launch(sched, *args, **kwargs)

    monkeypatch.setattr(llm_engine.core.runner, "launch", flaky)
    chunks = await collect(engine, prompt(12), SamplingParams(max_tokens=10, ignore_eos=True), "victim")
    assert chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "error"
    assert "injected" not in (chunks[-1].error or "") and chunks[-1].error
    assert_all_blocks_free(llm_engine)
    ok = await collect(engine, prompt(12), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), "after")
    assert ok[-1].outputs[0].finish_reason == "length"
    await engine.shutdown()


async def test_event_loop_runs_while_the_model_steps(engine):
    """Model steps run in a worker thread: other coroutines keep running between (and during) steps."""
    ticks = []

    async def ticker():
        while True:
            ticks.append(len(outputs))
            await asyncio.sleep(0)

    outputs = []
    task = asyncio.create_task(ticker())
    async for out in engine.generate(prompt(60), SamplingParams(max_tokens=30, ignore_eos=True), "long"):
        outputs.append(out)
    task.cancel()
    # The ticker ran while every one of the 30 outputs was being produced.
    assert set(range(len(outputs))) <= set(ticks)
    await engine.shutdown()


async def test_a_paused_request_waits_and_resumes_with_the_same_tokens(engine, tiny_model):
    """set_paused (the server's flow control for a client that stopped reading): a paused request gets no steps
    while the other runs, nor do any steps run while every request is paused; resumed, it ends with the tokens it
    gives alone."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=DELTA)
    prompts = [prompt(20, seed=1), prompt(9, seed=2)]
    gens = [engine.generate(p, params, f"p{i}") for i, p in enumerate(prompts)]
    tokens: list[list[int]] = [[], []]
    for i in (0, 1):
        tokens[i] += (await anext(gens[i])).outputs[0].token_ids
    engine.set_paused("p0", True)
    await asyncio.sleep(0.05)  # a step in flight when it was paused still lands
    held = engine.engine.core.scheduler.requests["p0"].num_output_tokens
    async for out in gens[1]:
        tokens[1] += out.outputs[0].token_ids
    assert engine.engine.core.scheduler.requests["p0"].num_output_tokens == held < 24
    core, calls = engine.engine.core, []
    schedule = core.schedule
    core.schedule = lambda: calls.append(1) or schedule()
    await asyncio.sleep(0.2)
    assert len(calls) <= 2  # every request paused: the step loop waits (it does not poll the scheduler)
    engine.set_paused("p0", False)
    async for out in gens[0]:
        tokens[0] += out.outputs[0].token_ids
    offline = LLM(tiny_model, dtype="float32", enforce_eager=True).generate(prompts, params)
    assert tokens == [o.outputs[0].token_ids for o in offline]
    assert_all_blocks_free(engine.engine)
    await engine.shutdown()


async def test_a_burst_of_intakes_lets_the_steps_through(engine):
    """Handlers that call intake_turn() before their intake (as the server's do) wait while a worker call's result
    waits for the step coroutine: a burst of slow intakes, all ready at once, has steps run between them instead of
    after the last."""
    steps = []
    engine.stats.add_listener(lambda step, totals: steps.append(step))
    gen = engine.generate(prompt(5), SamplingParams(max_tokens=400, ignore_eos=True), "long")
    await anext(gen)
    seen = []

    async def handler():
        await engine.intake_turn()
        seen.append(len(steps))
        time.sleep(0.003)  # a request's intake, holding the event loop

    await asyncio.gather(*(handler() for _ in range(40)))
    await gen.aclose()
    assert len(set(seen)) >= 5, seen  # without the gate: every intake before the next step (one value)
    await engine.shutdown()


def launch_waiting_engine(tiny_model):
    """An engine with async scheduling whose event loop waits for each launch, as on CUDA (waits_for_launch)."""
    engine = AsyncEngine.from_engine_args(
        EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_num_batched_tokens=32,
                   async_scheduling=True)
    )  # fmt: skip
    engine.waits_for_launch = True
    return engine


async def test_intake_runs_while_the_device_does_and_never_during_a_launch(tiny_model):
    """Where a launch queues device work (CUDA: waits_for_launch), the event loop's thread waits for each launch, and
    intakes run while the worker waits for the device; here on the CPU with async scheduling, the device's wait
    played by a sleep in wait_inflight."""
    engine = launch_waiting_engine(tiny_model)
    core, steps, launches = engine.engine.core, [], []
    engine.stats.add_listener(lambda step, totals: steps.append(step))
    launch, wait_inflight = core.launch, core.wait_inflight

    def timed_launch(work):
        t0 = time.perf_counter()
        try:
            return launch(work)
        finally:
            launches.append((t0, time.perf_counter()))

    def device_wait(done):
        time.sleep(0.004)
        return wait_inflight(done)

    core.launch, core.wait_inflight = timed_launch, device_wait
    gen = engine.generate(prompt(5), SamplingParams(max_tokens=200, ignore_eos=True), "long")
    await anext(gen)
    seen, intakes = [], []

    async def handler(arrival):
        await asyncio.sleep(arrival)
        await engine.intake_turn()
        seen.append(len(steps))
        t0 = time.perf_counter()
        time.sleep(0.002)  # a request's intake, holding the event loop
        intakes.append((t0, time.perf_counter()))

    await asyncio.gather(*(handler(0.0 if i < 20 else (i - 20) * 0.002) for i in range(40)))  # a burst, then more
    await gen.aclose()
    assert len(set(seen)) >= 5, seen
    assert len(launches) >= 5 and not [(a, b) for a, b in intakes for c, d in launches if a < d and c < b]
    await engine.shutdown()


async def test_outputs_go_out_before_a_long_launch_and_after_a_short_one(tiny_model):
    """Where the event loop waits for each launch (CUDA), the previous step's outputs are handed out after a decode
    step's launch (graph replays: short) but before the launch of a step that computes a prompt's chunk (eager layers:
    long), so that streams already decoding do not wait for it; here on the CPU with async scheduling."""
    engine = launch_waiting_engine(tiny_model)
    core, events = engine.engine.core, []
    launch, deliver = core.launch, engine._deliver

    def recorded_launch(work):
        events.append(("launch", work.eager))
        return launch(work)

    def recorded_deliver(outputs):
        if outputs:
            events.append(("deliver", None))
        return deliver(outputs)

    core.launch, engine._deliver = recorded_launch, recorded_deliver
    gen = engine.generate(prompt(5), SamplingParams(max_tokens=120, ignore_eos=True), "long")
    for _ in range(3):
        await anext(gen)
    later = [collect(engine, prompt(70, seed=i), SamplingParams(max_tokens=2), f"p{i}") for i in range(3)]
    await asyncio.gather(*later)
    await gen.aclose()
    await engine.shutdown()
    # each delivery right after a decode step's launch or right before a prompt chunk's (the last: when idle)
    kinds = ["after" if events[j - 1] == ("launch", False) else "before" if events[j + 1] == ("launch", True) else None
             for j, e in enumerate(events[:-1]) if e[0] == "deliver"]  # fmt: skip
    assert None not in kinds and kinds.count("after") >= 5 and kinds.count("before") >= 3, events
