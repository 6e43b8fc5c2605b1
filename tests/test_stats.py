"""Engine statistics: counters after real runs, the periodic log line."""

import random

from aserve import LLM, SamplingParams
from aserve.core.metrics import PeriodicLogger


def test_counters_and_periodic_log(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, num_gpu_blocks_override=10, max_model_len=128)
    stats = llm.engine.stats
    lines, steps = [], []
    stats.add_listener(PeriodicLogger(lines.append, interval=0.0))
    stats.add_listener(lambda step, s: steps.append(step))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]} for n in (20, 40, 60)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert stats.generation_tokens_total == 90 == sum(s.generation_tokens for s in steps)
    assert stats.prompt_tokens_total == 120
    assert stats.finished_total["length"] == 3
    assert stats.num_preemptions_total > 0 and sum(s.num_preemptions for s in steps) == stats.num_preemptions_total
    assert sum(len(s.time_to_first_token) for s in steps) == 3
    assert sum(len(s.e2e_latency) for s in steps) == 3
    assert sum(len(s.inter_token_latency) for s in steps) == 87
    assert sum(s.iteration_tokens for s in steps) == stats.scheduled_tokens_total >= 120 + 87
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert lines and "Avg generation throughput" in lines[-1] and "KV cache usage" in lines[-1]
