"""vLLM's LLMEngine loop: add_request, step() while has_unfinished_requests(), each request's outputs merged with
RequestOutput.add (aggregate for DELTA outputs, replace for CUMULATIVE ones) into what LLM.generate returns."""

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype=torch.float32, enforce_eager=True, max_model_len=128, debug_invariants=True)


def run_loop(engine, prompts: dict[str, str], params: SamplingParams, aggregate: bool) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    merged, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in merged:
                merged[out.request_id].add(out, aggregate=aggregate)
            else:
                merged[out.request_id] = out
        steps += 1
    assert steps > 1  # (the outputs came in several pieces)
    return merged


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_step_outputs_merge_into_the_final_output(llm, kind):
    params = SamplingParams(n=2, seed=3, max_tokens=6, logprobs=1, ignore_eos=True, output_kind=kind)
    prompts = {"a": "Hello there", "b": "One two"}
    merged = run_loop(llm.llm_engine, prompts, params, aggregate=kind is RequestOutputKind.DELTA)
    final = llm.generate(list(prompts.values()), params.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                         use_tqdm=False)  # fmt: skip
    for out, expected in zip((merged["a"], merged["b"]), final):
        assert out.finished and len(out.outputs) == 2
        for got, want in zip(sorted(out.outputs, key=lambda c: c.index), expected.outputs):
            assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "length")
            assert len(got.token_ids) == len(got.logprobs) == 6
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
