"""KV cache integrity: a storm of clients hanging up mid-request, KV exhaustion (preemption and recomputation with
unchanged outputs), and the invariant checker (--debug-invariants) that catches leaked, lost or doubly-held blocks
and inconsistent request queues."""

import asyncio
import importlib.util
import pathlib

import pytest
import reliability_common
from aserve_server import start_server, stop_server
from reliability_common import make_llm_engine, parse_sse, prompt_ids, stream_text
from test_server import assert_idle, make_client, metric

llm_engine, client = reliability_common.llm_engine, reliability_common.client  # fixtures, found by their names


# -- 1. disconnect storm -----------------------------------------------------------------------------------------


def load_bench(name: str):
    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_storm(tiny_model, tmp_path, num_requests: int) -> dict:
    """bench/reliability_storm.py against `aserve serve` (tiny model, 40 KV blocks, --debug-invariants)."""
    storm = load_bench("reliability_storm")
    log_path = tmp_path / "server.log"
    proc, url = start_server("--model", tiny_model, *storm.SERVER_FLAGS, timeout=120, log_path=str(log_path))
    try:
        result = asyncio.run(storm.storm(url, num_requests, disconnect=0.3, concurrency=64, seed=0))
    finally:
        stop_server(proc)
    log = log_path.read_text()
    assert "--debug-invariants" in " ".join(storm.SERVER_FLAGS) and "aserve: serving" in log
    assert result["problems"] == [], result["problems"][:20]
    assert storm.log_problems(log) == [], log[-5000:]  # no ERROR line, no traceback (invariant checks included)
    by_kind = result["by_kind"]
    assert sum(by_kind.values()) == num_requests and by_kind["slow_reader"] == round(0.1 * num_requests)
    assert by_kind["complete"] == num_requests - round(0.3 * num_requests) - by_kind["slow_reader"]
    assert result["stream_pauses"] > 0  # slow readers were paused (and got their whole answers: no problems)
    finished = result["finished"]
    # Every request ended; most hang-ups were seen as aborts (a few finish before the server notices).
    assert finished["error"] == 0 and finished["length"] >= by_kind["complete"] + by_kind["slow_reader"]
    assert finished["abort"] >= 0.15 * num_requests and finished["length"] + finished["abort"] <= num_requests
    return result


def test_disconnect_storm(tiny_model, tmp_path):
    """200 streams, 30 % of the clients hanging up before their first token or mid-stream and 10 % pausing their
    reading (their requests paused, then resumed): afterwards nothing is open, running or waiting, no KV block is
    held, the log is clean and answers are what they were before."""
    run_storm(tiny_model, tmp_path, 200)


@pytest.mark.slow
def test_disconnect_storm_2000(tiny_model, tmp_path):
    run_storm(tiny_model, tmp_path, 2000)


# -- 2. KV exhaustion --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_kv_exhaustion_preempts_and_every_request_completes_unchanged(client, tiny_model, prefix_caching):
    """16 KV blocks (256 tokens: the least max_model_len 256 allows) for 12 concurrent requests of up to 76 tokens
    each: requests are preempted (their blocks freed) and recomputed, every one completes, and greedy outputs equal
    those of the same concurrent load with ample KV (the module's engine)."""
    prompts = [prompt_ids(i, 12 + 3 * i) for i in range(12)]
    prompts[3] = prompts[2][:16] + prompts[3][16:]  # a shared full block: prefix hits on preempted requests' blocks
    max_tokens = [24 + 3 * i for i in range(12)]

    async def load(c) -> list[str]:
        async def one(i):
            body = {"prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0, "ignore_eos": True,
                    "stream": i % 2 == 0}  # fmt: skip
            resp = await c.post("/v1/completions", json=body)
            assert resp.status == 200
            if i % 2:
                return (await resp.json())["choices"][0]["text"]
            events = parse_sse(await resp.text())
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            return stream_text(events)

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(12))), 180)

    expected = await load(client)
    small = make_llm_engine(tiny_model, num_gpu_blocks_override=16, enable_prefix_caching=prefix_caching)
    assert small.core.num_kv_blocks == 16
    small_client = await make_client(small)
    try:
        got = await load(small_client)
        text = await (await small_client.get("/metrics")).text()
        assert metric(text, "aserve:num_preemptions_total") > 0
        assert metric(text, 'aserve:request_success_total{finished_reason="length",model_name="tiny"}') == 12
        assert metric(text, "aserve:num_requests_running") == 0 and metric(text, "aserve:kv_cache_usage_perc") == 0
        assert got == expected
        assert_idle(small)
    finally:
        await small_client.close()


# -- 3. the invariant checker ------------------------------------------------------------------------------------


def corrupt_leaked_ref(llm_engine, rid):
    block = llm_engine.core.kv_manager.req_to_blocks[rid][0]
    block.ref_cnt += 1
    return lambda: setattr(block, "ref_cnt", block.ref_cnt - 1)


def corrupt_free_and_held(llm_engine, rid):
    block, queue = llm_engine.core.kv_manager.req_to_blocks[rid][-1], llm_engine.core.kv_manager.pool.free_block_queue
    queue.append(block)
    return lambda: queue.remove(block)


def corrupt_lost_block(llm_engine, rid):
    """A block taken from the free list and referenced, but recorded for no request: it would never be freed."""
    queue = llm_engine.core.kv_manager.pool.free_block_queue
    block = queue.popleft()
    block.ref_cnt = 1
    return lambda: (setattr(block, "ref_cnt", 0), queue.append(block))


def corrupt_queue(llm_engine, rid):
    llm_engine.core.scheduler.waiting.append(llm_engine.core.scheduler.requests[rid])
    return llm_engine.core.scheduler.waiting.pop


def corrupt_lost_request(llm_engine, rid):
    request = llm_engine.core.scheduler.requests[rid]
    llm_engine.core.scheduler.running.remove(request)
    return lambda: llm_engine.core.scheduler.running.append(request)


def corrupt_request_table(llm_engine, rid):
    entry = llm_engine.output_processor.sequence_to_state.pop(rid)
    return lambda: llm_engine.output_processor.sequence_to_state.__setitem__(rid, entry)


@pytest.fixture(scope="module")
def small_engine(tiny_model):
    return make_llm_engine(tiny_model, num_gpu_blocks_override=32)


@pytest.mark.parametrize("corrupt,words", [
    (corrupt_leaked_ref, r"ref_cnt is 2 but 1 live request\(s\) hold it \(a leaked or lost reference\)"),
    (corrupt_free_and_held, r"is in the free list while 1 live request\(s\) hold it"),
    (corrupt_lost_block, r"ref_cnt is 1 but 0 live request\(s\) hold it"),
    (corrupt_queue, r"a request is queued twice"),
    (corrupt_lost_request, r"the queues \(\[\]\) and the live requests \(\['{rid}'\]\) differ"),
    (corrupt_request_table, r"queued sequence '{rid}' belongs to no live request"),
], ids=lambda v: v.__name__.removeprefix("corrupt_") if callable(v) else "")  # fmt: skip
def test_invariant_checker_catches_corrupted_state(small_engine, corrupt, words):
    """Each deliberately corrupted state (a leaked ref count, a block both free and held, a block held by nobody,
    inconsistent queues or request table) fails the check with a message that names the problem."""
    from aserve import SamplingParams
    from aserve.core.kv_cache_manager import InvariantError

    engine, rid = small_engine, corrupt.__name__
    engine.add_request(rid, {"prompt_token_ids": prompt_ids(0, 40)}, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt is computed: the request runs and holds 3 blocks
    engine.check_invariants()  # a sound state passes
    undo = corrupt(engine, rid)
    with pytest.raises(InvariantError, match=words.format(rid=rid)):
        engine.check_invariants()
    undo()
    engine.check_invariants()
    engine.abort_request(rid)
    assert_idle(engine)


def test_invariant_checker_runs_after_every_step_and_abort(small_engine):
    from aserve import SamplingParams
    from aserve.core.kv_cache_manager import InvariantError

    engine = small_engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompt_ids(1, 20)}, params)
    engine.add_request("b", {"prompt_token_ids": prompt_ids(2, 20)}, params)
    engine.step()
    undo = corrupt_leaked_ref(engine, "a")
    with pytest.raises(InvariantError, match="leaked or lost reference"):
        engine.step()
    undo()
    undo = corrupt_leaked_ref(engine, "b")
    with pytest.raises(InvariantError, match="leaked or lost reference"):
        engine.abort_request("a")
    undo()
    engine.abort_request("b")
    assert_idle(engine)
    engine.config.args.debug_invariants = (
        False  # off: not checked (it costs a pass over every block per step and abort)
    )
    try:
        engine.add_request("c", {"prompt_token_ids": prompt_ids(3, 20)}, params)
        engine.step()
        undo = corrupt_leaked_ref(engine, "c")
        engine.step()
        undo()
        engine.abort_request("c")
    finally:
        engine.config.args.debug_invariants = True
    assert_idle(engine)
