"""aserve/kernels/cpu.py: the greedy pick against torch (first maximum, non-finite rows flagged), and the sampler
using it for greedy batches with the same tokens as its float32 path."""

import pytest
import torch
from test_greedy import check_pick, hard_logits

from aserve.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152 + 7])
def test_greedy_pick_matches_torch(dtype, vocab):
    logits = hard_logits(vocab, dtype)
    check_pick(logits, *cpu.greedy_pick(logits))


def test_greedy_pick_strided_rows():
    logits = torch.randn(4, 100, dtype=torch.bfloat16)[:, :64]  # row stride 100
    idx, bad = cpu.greedy_pick(logits)
    assert torch.equal(idx, logits.float().max(dim=-1).indices) and not bad.any()


def test_sampler_greedy_batch_uses_bf16_logits_same_tokens():
    """The sampler on bf16 logits of a greedy batch (the C pick) emits what it emits from the float32 logits (torch
    path), drafts included, and flags a NaN row."""
    from aserve.core.request import Request
    from aserve.sampling_params import SamplingParams
    from aserve.worker.sampler import Sampler

    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8), eos_token_id=0) for i in range(3)]
    logits = torch.randn(3, 1000).to(torch.bfloat16)
    logits[2, 5] = float("nan")
    sampler = Sampler(torch.device("cpu"), seed=0)
    fast = sampler(logits, reqs)
    slow = sampler(logits.float(), reqs)
    assert sampler._greedy_pick(logits, []) is not None
    assert fast.token_ids[:2] == slow.token_ids[:2] == [[int(logits[i].float().argmax())] for i in range(2)]
    assert fast.nonfinite == slow.nonfinite == [False, False, True]
    # drafts: row 0's draft is its argmax (accepted), row 1's is not
    top = logits[:2].float().argmax(dim=-1).tolist()
    rows = torch.cat([logits[0:1], logits[0:1], logits[1:2], logits[1:2]])
    out = sampler(rows, reqs[:2], [[top[0]], [top[1] + 1]])
    assert out.token_ids == [[top[0], top[0]], [top[1]]]
