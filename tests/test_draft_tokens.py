"""A model drafter's tokens reach the host lazily: the engine updates from the step, schedules the verification and
launches it while the drafts are computed (its inputs take them on the device), and reads their values only when the
verification's sampler needs them."""

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.worker.draft_tokens import DraftTokens, PendingDrafts


def test_draft_tokens_give_length_and_leading_slices_without_reading():
    chosen = torch.tensor([[11, 21], [12, 22], [13, 23]])  # [k_max, requests]
    pending = PendingDrafts(chosen)
    first, second = DraftTokens(pending, 0, 3), DraftTokens(pending, 1, 2)
    assert len(first) == 3 and len(second) == 2 and bool(second)
    head = first[:2]
    assert isinstance(head, DraftTokens) and len(head) == 2 and len(first[:0]) == 0 and len(second[:9]) == 2
    assert pending._rows is None  # nothing read yet
    assert head == [11, 12] and list(first) == [11, 12, 13] and second.tolist() == [21, 22]
    assert first[-1] == 13 and first[1:] == [12, 13] and first[:-1] == [11, 12] and first != [11]


def test_the_verification_step_reads_the_drafts_after_the_update_and_schedule(tiny_model, monkeypatch):
    # one step at a time, as the engine runs without async scheduling (the default on the CPU, not on a GPU)
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, async_scheduling=False,
              speculative_config={"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3})  # fmt: skip
    core = llm.engine.core
    events = []
    read = PendingDrafts.row

    def row(self, i):
        if self._rows is None:
            events.append("read")
        return read(self, i)

    monkeypatch.setattr(PendingDrafts, "row", row)
    forward = core.runner._forward

    def launched(*args):
        events.append("forward")
        return forward(*args)

    monkeypatch.setattr(core.runner, "_forward", launched)
    llm.engine.add_request("r", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(temperature=0, max_tokens=24))
    verified = 0
    while core.has_unfinished():
        work = core.schedule()
        events.append("scheduled")
        done = core.execute(work)
        if work.sched.verifies:
            verified += 1
            # the drafts the step before proposed: not read by its update, this schedule nor this step's forward
            # (its inputs take them on the device), but by its sampler
            assert events[-4:] == ["updated", "scheduled", "forward", "read"]
        core.update(work, done)
        events.append("updated")
    assert verified > 1


@pytest.mark.parametrize("engine, penalty", [({}, 1.0), ({"num_gpu_blocks_override": 8, "max_model_len": 128}, 1.0),
                                             ({}, 1.3)])  # fmt: skip
def test_lazy_drafts_keep_greedy_outputs(tiny_model, engine, penalty):
    """Penalties read the drafts as output tokens (the sampler takes them as lists)."""
    prompts = [{"prompt_token_ids": [5 + i % 7 for i in range(n)]} for n in (9, 30, 51)]
    params = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=penalty, presence_penalty=penalty - 1)
    plain = LLM(tiny_model, dtype="float32", enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = LLM(tiny_model, dtype="float32", enforce_eager=True, debug_invariants=True, **engine,
               speculative_config={"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 4})  # fmt: skip
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.stats.spec_draft_tokens_total > 0


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_an_int8_draft_head_drafts_and_keeps_outputs(tiny_model, temperature):
    """layer_skip through an int8 copy of the head: drafts accepted; greedy tokens unchanged (verification uses the
    model's own head); sampled requests run and accept drafts (their draws differ with the draft distribution)."""
    prompts = [{"prompt_token_ids": [5 + i % 7 for i in range(n)]} for n in (9, 30)]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=24)
    spec = {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}
    runs = {}
    for head in ("model", "int8"):
        llm = LLM(tiny_model, dtype="float32", enforce_eager=True, debug_invariants=True,
                  speculative_config={**spec, "draft_head": head})  # fmt: skip
        runs[head] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.stats.spec_accepted_tokens_total > 0
        drafter = llm.engine.core.runner.drafter
        assert (drafter.lm_head is None) == (head == "model")
    if temperature == 0:
        plain = LLM(tiny_model, dtype="float32", enforce_eager=True)
        assert runs["int8"] == runs["model"] == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert drafter.lm_head.weight.dtype == torch.int8


def test_draft_head_is_checked():
    from aserve.spec.config import SpeculativeConfig

    with pytest.raises(ValueError, match="draft_head must be one of model, int8"):
        SpeculativeConfig.parse({"method": "layer_skip", "num_layers": 1, "draft_head": "fp4"})
    with pytest.raises(ValueError, match="unknown speculative_config keys for ngram: draft_head"):
        SpeculativeConfig.parse({"method": "ngram", "draft_head": "int8"})
    assert SpeculativeConfig.parse({"method": "layer_skip", "num_layers": 1, "draft_head": "int8"}).draft_head == "int8"


def zero_layers_after(llm, first: int) -> None:
    """Layers `first`.. add nothing to the residual stream (their attention and MLP output projections zeroed)."""
    model = llm.engine.core.runner.model
    for layer in model.layers[first:]:
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            module.weight.data.zero_()
    model.process_weights_after_loading()  # the CPU kernels' packed copies


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["gqa", "gemma2"])
def test_layer_skip_verification_resumes_from_the_drafting(tiny_model_factory, dtype, variant, monkeypatch):
    """The verification step takes the draft layers' hidden states (and KV) from the drafting instead of computing
    them again: where the layers after the draft's add nothing, every draft is accepted, in bfloat16 too, and the
    greedy tokens are those of the same model without speculation."""
    model_dir = tiny_model_factory(variant)
    prompts = [{"prompt_token_ids": [5 + (i * 7) % 31 for i in range(n)]} for n in (9, 30, 51)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = LLM(model_dir, dtype=dtype, enforce_eager=True,
               speculative_config={"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 4})  # fmt: skip
    zero_layers_after(spec, 1)
    drafter = spec.engine.core.runner.drafter
    resumed = []
    rows = drafter.resume_rows
    monkeypatch.setattr(
        drafter, "resume_rows", lambda sources, graph: resumed.append(len(sources[1])) or rows(sources, graph)
    )
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    stats = spec.engine.stats
    assert stats.spec_draft_tokens_total > 60 and stats.spec_accepted_tokens_total == stats.spec_draft_tokens_total
    # 40 tokens at 5 a step; the most rows a step resumes: three requests' last token and four drafts each
    assert len(resumed) >= 7 and max(resumed) == 15
    if dtype == "float32":
        plain = LLM(model_dir, dtype=dtype, enforce_eager=True)
        zero_layers_after(plain, 1)
        assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
