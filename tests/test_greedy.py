"""aserve/kernels/greedy.py (the GPU greedy pick; Triton's interpreter on CPU) against torch: first maximum, non-finite
rows flagged, indices inside the vocabulary; and, on a GPU, the sampler using it with the tokens of its float32 path."""

import pytest
import torch

from aserve.kernels import greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def hard_logits(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """10 rows of random logits with, when the vocabulary allows, the cases a greedy pick gets wrong most easily."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(10, vocab, generator=g) * 4).to(dtype)
    if vocab > 3:
        logits[1, :] = 1.0  # all tied: the first index
        logits[2, vocab // 2] = logits[2, vocab - 1] = 100.0  # a tie between two maxima (two chunks when large)
        logits[3, 2] = float("nan")
        logits[4, vocab - 1] = float("inf")
        logits[5, 0] = float("-inf")
        logits[6, :] = -0.0
        logits[6, 3] = 0.0  # -0.0 == 0.0: the first index still
        logits[7, :] = float("nan")  # nothing compares: the index must still be inside the vocabulary
    return logits


def check_pick(logits: torch.Tensor, idx: torch.Tensor, bad: torch.Tensor) -> None:
    """(idx, bad) is torch's first maximum for the finite rows and flags exactly the rows holding NaN / inf."""
    assert idx.dtype == torch.int64 and bad.dtype == torch.bool
    idx, bad = idx.cpu(), bad.cpu()
    want_bad = ~torch.isfinite(logits.float().sum(dim=-1))
    assert torch.equal(bad, want_bad)
    ok = ~want_bad
    assert torch.equal(idx[ok], logits.float().max(dim=-1).indices[ok])
    assert ((idx >= 0) & (idx < logits.shape[1])).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 15, 4096, 3 * 4096 + 7])
def test_greedy_pick_matches_torch(dtype, vocab):
    logits = hard_logits(vocab, dtype)
    check_pick(logits, *greedy.greedy_pick(logits.to(DEVICE)))


def test_greedy_pick_strided_rows_and_empty():
    logits = torch.randn(4, 5000, dtype=torch.float16)[:, :4500].to(DEVICE)  # row stride 5000, two chunks
    idx, bad = greedy.greedy_pick(logits)
    assert torch.equal(idx.cpu(), logits.float().max(dim=-1).indices.cpu()) and not bad.any()
    idx, bad = greedy.greedy_pick(logits[:0])
    assert idx.shape == bad.shape == (0,)
    assert not greedy.supports(logits[:, :0]) and not greedy.supports(logits.t()) and not greedy.supports(logits[0])
    assert not greedy.supports(logits.to(torch.int32))


@pytest.mark.skipif(DEVICE != "cuda", reason="the sampler takes the Triton pick for CUDA logits only")
def test_sampler_greedy_batch_on_gpu_same_tokens():
    """On CUDA bf16 logits of a greedy batch the sampler (Triton pick) emits what its float32 path emits, drafts
    included, and flags a NaN row; launch() (async scheduling) too; min_tokens still to reach takes the torch path."""
    from aserve.core.request import Request
    from aserve.sampling_params import SamplingParams
    from aserve.worker.sampler import Sampler, SampleRow

    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8), eos_token_id=0) for i in range(3)]
    logits = torch.randn(3, 128256, device="cuda").to(torch.bfloat16)
    logits[2, 5] = float("nan")
    sampler = Sampler(torch.device("cuda"), seed=0)
    assert sampler._greedy_pick(logits, [SampleRow(r, []) for r in reqs]) is not None
    fast = sampler(logits, reqs)
    slow = sampler(logits.float(), reqs)  # float32 logits take the pick too: compare with torch's own argmax
    want = [[int(logits[i].float().argmax())] for i in range(2)]
    assert fast.token_ids[:2] == slow.token_ids[:2] == want
    assert fast.nonfinite == slow.nonfinite == [False, False, True]
    top = [w[0] for w in want]
    rows = torch.cat([logits[0:1], logits[0:1], logits[1:2], logits[1:2]])
    out = sampler(rows, reqs[:2], [[top[0]], [top[1] + 1]])
    assert out.token_ids == [[top[0], top[0]], [top[1]]]
    assert sampler.launch(logits[:2], reqs[:2]).result().token_ids == want
    reqs[0].sampling_params.min_tokens = 4
    assert sampler._greedy_pick(logits, [SampleRow(reqs[0], [])]) is None


def test_engine_warms_up_the_greedy_pick(tiny_model):
    """The runner's start-up sampler warm-up (run by the engine on a GPU) picks from a made-up row of the model's
    logits and leaves the engine's output as it was."""
    from aserve import LLM, SamplingParams

    llm = LLM(tiny_model, dtype="float32", enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids
    calls = []
    sampler = llm.engine.core.runner.sampler
    supports, pick = sampler._greedy_kernel
    sampler._greedy_kernel = (supports, lambda logits: calls.append(logits.shape) or pick(logits))
    llm.engine.core.runner.warm_up_sampler()
    assert calls == [(1, llm.engine.core.runner.model.config.vocab_size)]
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids == before


def test_warm_up_runs_the_heads_at_every_row_count_class(tiny_model):
    """A step's logits rows vary with its batch, outside the CUDA graphs, and a Triton head (a quantised one, a
    drafter's int8 copy) compiles once per row-count class: the warm-up runs the target's head and the drafter's at
    1, 2, each power of two from 16 and the count after it, and the most rows a step can have."""
    from aserve import LLM, SamplingParams
    from aserve.worker.profiling import warm_up_rows

    assert warm_up_rows(1) == [1] and warm_up_rows(5) == [1, 2, 5]
    assert warm_up_rows(80) == [1, 2, 16, 17, 32, 33, 64, 65, 80]
    spec = {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3, "draft_head": "int8"}
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_num_seqs=8, speculative_config=spec)
    runner = llm.engine.core.runner
    params = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids
    rows = {"target": [], "draft": []}
    for name, head in (("target", runner.model.lm_head), ("draft", runner.drafter.lm_head)):
        head.register_forward_hook(lambda m, args, out, name=name: rows[name].append(args[0].shape[0]))
    runner.warm_up_sampler(8 * 4)
    assert rows == {"target": [1, 2, 16, 17, 32], "draft": [1, 2, 8]}
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0].token_ids == before
