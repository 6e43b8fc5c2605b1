"""aserve/worker/piecewise_graphs.py's host side on CPU (the graphs themselves need a GPU: bench/piecewise_graphs.py
checks them against the eager forward there): which steps replay which bucket, the padding of a step's tokens and
requests in the input buffers, and the capture's stand-in for attention run through a real model's forward."""

from types import SimpleNamespace

import torch

from aserve.worker.input_buffers import InputBuffers
from aserve.worker.piecewise_graphs import PiecewiseGraphs
from aserve.worker.step_plan import StepLayout


def fake_runner(max_tokens=64, max_reqs=4):
    buffers = InputBuffers(max_tokens, max_reqs, 8, torch.device("cpu"))
    return SimpleNamespace(buffers=buffers, max_num_seqs=max_reqs)


def test_which_steps_replay_which_bucket():
    pieces = PiecewiseGraphs(fake_runner(), None, None, max_tokens=100)
    assert pieces.buckets == [16, 32, 64, 96]
    step = StepLayout(2, 40, max_query_len=30)
    assert pieces.bucket_for(step) is None  # nothing captured (or the capture failed): eager
    pieces.pieces = dict.fromkeys(pieces.buckets)
    assert pieces.bucket_for(step) == 64
    assert pieces.bucket_for(StepLayout(1, 16, max_query_len=16)) == 16
    assert pieces.bucket_for(StepLayout(3, 3, max_query_len=1)) is None  # decodes only: the decode graphs' steps
    assert pieces.bucket_for(StepLayout(1, 97, max_query_len=97)) is None  # past the largest bucket: eager


def test_pad_fills_the_steps_tokens_and_requests_to_the_bucket():
    runner = fake_runner()
    host = runner.buffers.np
    host["input_ids"][:40], host["positions"][:40], host["slot_mapping"][:, :40] = 9, 9, 9  # an earlier step's
    host["query_start_loc"][:5], host["seq_lens"][:4] = 99, 77
    host["input_ids"][:20], host["slot_mapping"][:, :20] = 7, 5  # this step: 2 requests, 20 tokens
    host["query_start_loc"][:3], host["seq_lens"][:2] = [0, 12, 20], [12, 30]
    PiecewiseGraphs(runner, None, None, max_tokens=64).pad(2, 20, 32)
    assert (host["input_ids"][:20] == 7).all() and (host["slot_mapping"][:, :20] == 5).all()
    # the padding: token 0 at position 0, writing nothing; up to the bucket only
    assert (host["input_ids"][20:32] == 0).all() and (host["positions"][20:32] == 0).all()
    assert (host["slot_mapping"][:, 20:32] == -1).all() and (host["input_ids"][32:40] == 9).all()
    # requests past the step's: empty, at the end of its tokens
    assert host["query_start_loc"][:5].tolist() == [0, 12, 20, 20, 20] and host["seq_lens"].tolist() == [12, 30, 0, 0]


def test_stand_in_through_a_model_forward(tiny_model):
    """The capture's stand-in takes the calls a model makes into its attention backend (outside a capture: the
    warm-up), copies q / k / v into buffers sized for the largest bucket, returns the shared output buffer, and
    leaves the backend as it was."""
    from aserve import LLM

    runner = LLM(tiny_model, dtype="float32", enforce_eager=True, max_num_batched_tokens=64).engine.core.runner
    pieces = PiecewiseGraphs(runner, None, runner.backend, max_tokens=64)
    dev = runner.buffers.device
    dev["input_ids"][:32], dev["positions"][:32] = 5, torch.arange(32)
    pieces.pad(1, 32, 32)
    meta = pieces.capture_meta(32)
    with pieces._stand_in(meta, None):
        hidden = runner.model(dev["input_ids"][:32], dev["positions"][:32], runner.kv_caches, meta)
    assert hidden.shape == (32, runner.hf_config.hidden_size) and torch.isfinite(hidden).all()
    assert "forward" not in vars(runner.backend) and "attend" not in vars(runner.backend)
    heads, kv_heads = runner.hf_config.num_attention_heads, runner.hf_config.num_key_value_heads
    shapes = {(name, shape[0]) for name, shape, _ in pieces._buffers}
    assert shapes == {("q", heads), ("k", kv_heads), ("v", kv_heads), ("out", heads)}
    assert all(buffer.shape[0] == 64 for buffer in pieces._buffers.values())
