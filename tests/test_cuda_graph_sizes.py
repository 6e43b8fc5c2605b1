"""vLLM's --cuda-graph-sizes: which decode steps replay a CUDA graph (aserve/worker/cuda_graphs.py capture_sizes), as
a flag and an `LLM(...)` keyword; on a GPU, the graphs captured."""

from types import SimpleNamespace

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.cli import build_parser, engine_args_from
from aserve.worker.cuda_graphs import StepGraphs, capture_sizes


def test_sizes_as_vllm_reads_them():
    """One value N: 1, 2, 4 and each multiple of 8 up to N; several: those; none past the most requests a step
    holds (a larger size becomes that limit); no value: aserve's buckets up to the limit, the limit included."""
    assert capture_sizes([20], 256) == [1, 2, 4, 8, 16]
    assert capture_sizes([2], 256) == [1, 2]
    assert capture_sizes([3, 1, 100], 64) == [1, 3, 64]
    assert capture_sizes(None, 100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    runner = SimpleNamespace(max_num_batched_tokens=8192, cuda_graph_sizes=[16])
    graphs = StepGraphs(runner, None, None, max_requests=256)
    assert graphs.key_for(3, 3, 1) == (4, 4) and graphs.key_for(9, 9, 1) == (16, 16)
    assert graphs.key_for(17, 17, 1) is None  # past the largest size: eager


def test_flag_and_keyword(tiny_model):
    args = engine_args_from(build_parser().parse_args(["serve", tiny_model, "--cuda-graph-sizes", "1", "8", "32"]))
    assert args.cuda_graph_sizes == [1, 8, 32]
    for bad in ([0], []):
        with pytest.raises(ValueError, match="cuda_graph_sizes must be sizes >= 1"):
            LLM(tiny_model, dtype=torch.float32, max_model_len=128, cuda_graph_sizes=bad)
    llm = LLM(tiny_model, dtype=torch.float32, max_model_len=128, cuda_graph_sizes=[8])
    assert llm.engine.core.runner.cuda_graph_sizes == [8]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_gpu_captures_those_sizes(tiny_model):
    llm = LLM(tiny_model, max_model_len=256, cuda_graph_sizes=[4])
    assert sorted(llm.engine.core.runner.graphs.graphs) == [(1, 1), (2, 2), (4, 4)]
    outs = llm.generate(["Hello"] * 6, SamplingParams(temperature=0, max_tokens=4))  # 6 requests: eager steps
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
