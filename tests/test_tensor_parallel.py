"""Tensor parallelism on CPU: 2 ranks (the engine's process and a spawned worker) over gloo, float32 tiny models. Greedy
output equals transformers' generate and the one-rank engine's, token for token, through the offline LLM and over
HTTP; a worker that dies stops the server with an error; no worker outlives its engine.

Each engine starts a process (seconds), so the default run builds few: one LLM that drives chunked prefill,
preemption, async scheduling and prefix caching at once (GQA, KV heads split), one server (Qwen2: q/k/v biases, a
single KV head replicated on both ranks, a vocabulary split unevenly), the mixture-of-experts models (16-bit
experts, and FP8 experts with their scales). The sweep over every model family is slow."""

import gc
import os
import random
import shutil
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from aserve_server import start_server, stop_server
from openai import OpenAI
from tiny_models import hf_greedy, make_config

from aserve import LLM, SamplingParams
from aserve.cli import build_parser, engine_args_from
from aserve.distributed.group import TensorParallelError
from aserve.distributed.sharding import check_shardable
from aserve.layers.quantization.awq import AWQConfig
from aserve.layers.quantization.fp8_config import Fp8Config
from aserve.layers.quantization.gptq import GPTQConfig

MAX_NEW = 24
PROMPT_LENS = (3, 17, 33, 50, 64)
# A 16-token budget (chunked prefill), 10 blocks of 16 for 5 requests growing to 27..88 tokens (preemption), async
# scheduling (rank 0 broadcasts each step's sampled tokens: the worker's next inputs), prefix caching (the default).
STRESS = dict(max_num_batched_tokens=16, num_gpu_blocks_override=10, max_model_len=128, async_scheduling=True)
ENGINE = dict(dtype="float32", enforce_eager=True, debug_invariants=True)
SERVER_FLAGS = ("-tp", "2", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                "--num-gpu-blocks-override", "64")  # fmt: skip


def prompts_for(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(n)] for n in PROMPT_LENS]


def greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, [o.outputs[0].token_ids for o in outs]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` started with multiprocessing's spawn (its tensor-parallel workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == pid and "spawn_main" in cmdline:
            found.append(int(entry))
    return found


def test_tp2_equals_transformers_and_one_rank(tiny_model_factory):
    """GQA with 2 KV heads (one per rank), every scheduler feature at once; then prefix caching and prompt logprobs
    (scored in 16-token chunks, each chunk's logits gathered from both ranks); then the engine is dropped and its
    worker is gone."""
    path = tiny_model_factory("gqa")
    prompts = prompts_for()
    expected = hf_greedy(path, prompts, MAX_NEW)
    single = LLM(path, **ENGINE, **STRESS)
    _, one_rank = greedy(single, prompts)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE, **STRESS)
    core = llm.engine.core
    assert core.workers is not None and core.async_scheduling
    pids = core.workers.pids
    assert len(pids) == 1 and all(alive(p) for p in pids)
    outs, got = greedy(llm, prompts)
    assert got == expected == one_rank
    for o, exp in zip(outs, expected):
        assert o.outputs[0].finish_reason == ("stop" if exp[-1] == 1 else "length")
    assert core.scheduler.num_preemptions > 0
    assert core.kv_manager.pool.num_free_blocks == core.num_kv_blocks and core.inflight is None
    # The longest prompt alone, twice: the second run starts from its cached blocks, with the same output.
    for _ in range(2):
        outs, again = greedy(llm, prompts[-1:])
        assert again == expected[-1:]
    assert outs[0].num_cached_tokens >= 48
    scoring = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    scored = [engine.generate({"prompt_token_ids": prompts[3]}, scoring, use_tqdm=False)[0].prompt_logprobs
              for engine in (single, llm)]  # fmt: skip
    assert len(scored[1]) == PROMPT_LENS[3] and scored[1][0] is None
    for one, two in zip(scored[0][1:], scored[1][1:]):
        assert one.keys() == two.keys()
        for token in one:
            assert one[token].rank == two[token].rank and abs(one[token].logprob - two[token].logprob) < 1e-4
    del llm, core, outs
    gc.collect()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_server_tp2_parity_then_a_killed_worker_stops_it(tiny_model_factory, tmp_path):
    """Qwen2 (q/k/v biases split with their heads), one KV head replicated on both ranks, a vocabulary of 385 split
    193 + 192 (+1 padding): served with -tp 2, queried with the openai client; then SIGKILL the worker: the server
    exits with status 1 and says why, promptly. (Token ids: the one-rank engine's equal transformers'; the server's
    text equals that engine's.)"""
    path = tiny_model_factory("qwen2_mqa")
    prompts = prompts_for(1)
    expected = hf_greedy(path, prompts, MAX_NEW)
    one_rank, tokens = greedy(LLM(path, **ENGINE), prompts)  # the texts to expect
    assert tokens == expected
    log = tmp_path / "server.log"
    proc, url = start_server("--model", path, *SERVER_FLAGS, "--max-num-batched-tokens", "32", log_path=str(log))
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        for one, exp in zip(one_rank, expected):
            r = client.completions.create(model=model, prompt=one.prompt_token_ids, max_tokens=MAX_NEW, temperature=0)
            assert r.choices[0].text == one.outputs[0].text
            assert r.usage.completion_tokens == len(exp)
            assert r.choices[0].finish_reason == ("stop" if exp[-1] == 1 else "length")
        stream = client.completions.create(model=model, prompt=prompts[2], max_tokens=MAX_NEW, temperature=0,
                                           stream=True)  # fmt: skip
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == one_rank[2].outputs[0].text
        workers = spawned_children(proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
    finally:
        stop_server(proc)
    output = log.read_text()
    assert f"worker rank 1 (pid {workers[0]}) exited with code -9" in output
    assert "aserve: error: the engine stopped" in output


def test_tp2_mixture_of_experts(tiny_model_factory, tmp_path):
    """Mixtral's experts split across the two ranks (each expert's 1/2 of the intermediate width, the router on both),
    every scheduler feature at once: transformers' tokens; then the same model from transformers' stacked expert
    tensors (experts.gate_up_proj / down_proj), sliced alike."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("mixtral")
    prompts = prompts_for(1)
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE, **STRESS)
    try:
        assert greedy(llm, prompts)[1] == expected
        assert llm.engine.core.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()
    stacked = str(tmp_path / "stacked")
    shutil.copytree(path, stacked, ignore=shutil.ignore_patterns("*.safetensors"))
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(stacked, "model.safetensors"))
    llm = LLM(stacked, tensor_parallel_size=2, **ENGINE)
    try:
        assert greedy(llm, prompts)[1] == expected
    finally:
        llm.engine.shutdown()


def test_tp2_fp8_checkpoint_experts(tiny_model_factory, tmp_path, monkeypatch):
    """Qwen3-MoE with FP8 experts (compressed-tensors, a scale per output row; the dense linears FP8 too): each
    rank's rows of gate / up with their scales, its columns of down with down's scales whole; transformers' tokens
    on the dequantised checkpoint."""
    import test_fp8_checkpoints
    from test_moe_fp8 import LINEARS, MIXTRAL_EXPERTS

    monkeypatch.setattr(test_fp8_checkpoints, "LINEARS", LINEARS + MIXTRAL_EXPERTS)
    fp8_dir, deq_dir = test_fp8_checkpoints.fp8_checkpoint(tiny_model_factory("qwen3_moe"), str(tmp_path / "fp8"),
                                                           "ct-channel")  # fmt: skip
    prompts = prompts_for(2)
    llm = LLM(fp8_dir, tensor_parallel_size=2, **ENGINE, max_num_batched_tokens=16)
    try:
        assert greedy(llm, prompts)[1] == hf_greedy(deq_dir, prompts, MAX_NEW)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["fp8-static", "at-load"])
def test_tp2_fp8_experts_sweep(tiny_model_factory, tmp_path, monkeypatch, source):
    """Mixtral's FP8 experts across two ranks: a checkpoint's per-tensor scales with static input scales
    (transformers' tokens on the dequantised checkpoint), and every linear and expert quantised at load, where each
    rank rounds its own slice, so that a row-parallel weight (o_proj, an expert's w2) has a scale per row for each
    half of its inputs: transformers' tokens on the checkpoint rounded so."""
    import test_fp8_checkpoints
    from test_fp8 import fp8_rounding, rounded_copy
    from test_moe_fp8 import LINEARS, MIXTRAL_EXPERTS

    path, prompts = tiny_model_factory("mixtral"), prompts_for(3)
    if source == "at-load":
        halves = rounded_copy(path, str(tmp_path / "halves"), linears=("o_proj", "w2"),
                              rounding=lambda w: torch.cat([fp8_rounding(h) for h in w.chunk(2, 1)], 1))  # fmt: skip
        reference = rounded_copy(halves, str(tmp_path / "rounded"), linears=("q_proj", "k_proj", "v_proj", "w1", "w3"))
        llm = LLM(path, quantization="fp8", tensor_parallel_size=2, **ENGINE, **STRESS)
    else:
        monkeypatch.setattr(test_fp8_checkpoints, "LINEARS", LINEARS + MIXTRAL_EXPERTS)
        fp8_dir, reference = test_fp8_checkpoints.fp8_checkpoint(path, str(tmp_path / "fp8"), source)
        llm = LLM(fp8_dir, tensor_parallel_size=2, **ENGINE, **STRESS)
    try:
        assert greedy(llm, prompts)[1] == hf_greedy(reference, prompts, MAX_NEW)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("fmt", ["awq", pytest.param("gptq", marks=pytest.mark.slow)])
def test_tp2_int4_experts(tiny_model_factory, tmp_path, monkeypatch, fmt):
    """Mixtral with AWQ / GPTQ int4 experts and linears in groups of 16: gate / up's packed outputs and down's
    packed inputs with their groups (scales, zero points, GPTQ's group indices renumbered from 0) split across the
    ranks; transformers' tokens on the dequantised checkpoint."""
    import test_awq_model
    import test_gptq
    from test_moe_int4 import MIXTRAL_EXPERTS

    monkeypatch.setattr(test_awq_model, "LINEARS", test_awq_model.LINEARS + MIXTRAL_EXPERTS)
    monkeypatch.setattr(test_gptq, "LINEARS", test_awq_model.LINEARS + MIXTRAL_EXPERTS)
    monkeypatch.setattr(test_gptq, "_INPUT_OF", {**test_gptq._INPUT_OF, "w1": "mlp", "w3": "mlp", "w2": "down"})
    path = tiny_model_factory("mixtral")
    if fmt == "awq":
        int4_dir = test_awq_model.autoawq_checkpoint(path, str(tmp_path / "awq"), 16, skip=("gate",))
        reference = test_awq_model.dequantized_checkpoint(int4_dir, str(tmp_path / "deq"))
    else:
        int4_dir, reference = test_gptq.gptq_checkpoint(path, str(tmp_path / "gptq"), 16, sym=False, desc_act=False,
                                                        version=1)  # fmt: skip
    prompts = prompts_for(4)
    llm = LLM(int4_dir, quantization=fmt, tensor_parallel_size=2, **ENGINE, max_num_batched_tokens=16)
    try:
        assert greedy(llm, prompts)[1] == hf_greedy(reference, prompts, MAX_NEW)
    finally:
        llm.engine.shutdown()


def test_tp2_deterministic_mode_keeps_a_requests_bits_in_any_batch(tiny_model_factory):
    """Deterministic mode across two ranks: a seeded request's tokens and logprobs alone equal its own among seven
    other requests (each rank's batch-invariant kernels, one all-reduce order)."""
    llm = LLM(tiny_model_factory("gqa"), tensor_parallel_size=2, deterministic=True, **ENGINE, max_model_len=256)
    try:
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_NEW, logprobs=2)
        target = {"prompt_token_ids": list(range(5, 40))}
        others = [{"prompt_token_ids": list(range(50 + i, 80 + 2 * i))} for i in range(7)]
        alone = llm.generate([target], params)[0].outputs[0]
        beside = llm.generate(others[:3] + [target] + others[3:], params)[3].outputs[0]
    finally:
        llm.engine.shutdown()
    assert alone.token_ids == beside.token_ids
    assert [{t: lp.logprob for t, lp in e.items()} for e in alone.logprobs] == [
        {t: lp.logprob for t, lp in e.items()} for e in beside.logprobs]  # fmt: skip


def test_refused_clearly_before_any_process_starts(tiny_model_factory):
    mixtral = make_config("mixtral")
    with pytest.raises(ValueError, match="AWQ experts: tensor_parallel_size 2 gives each rank 32 .* groups of 64"):
        check_shardable(mixtral, 2, AWQConfig(group_size=64))  # experts of 64: 32 a rank
    check_shardable(mixtral, 2, AWQConfig(group_size=32))
    qwen3_moe = make_config("qwen3_moe")  # experts of 48: 24 a rank at TP 2, half a 48 x 48 tile
    block = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [48, 48]})
    with pytest.raises(ValueError, match="48 x 48 scale tiles: .* 24 of an expert's intermediate width"):
        check_shardable(qwen3_moe, 2, block)
    check_shardable(qwen3_moe, 2, Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [8, 8]}))
    check_shardable(mixtral, 2, Fp8Config.from_config({"quant_method": "fp8"}))
    gqa = make_config("gqa")  # at TP 2 a rank has 16 rows of k / v (one head of 16), 64 of q and of the MLP
    with pytest.raises(ValueError, match="FP8 32 x 32 scale tiles: tensor_parallel_size 2"):
        check_shardable(gqa, 2, Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [32, 32]}))
    check_shardable(gqa, 2, Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [16, 16]}))
    with pytest.raises(ValueError, match="experts' intermediate size"):
        check_shardable(mixtral, 2 * mixtral.intermediate_size, None)
    cfg = make_config("gqa")  # 8 heads, 2 KV heads, MLP 128
    with pytest.raises(ValueError, match="8 attention heads"):
        check_shardable(cfg, 3, None)
    three_kv_heads = SimpleNamespace(architectures=["LlamaForCausalLM"], num_attention_heads=6, num_key_value_heads=3,
                                     hidden_size=96, intermediate_size=128)  # fmt: skip
    with pytest.raises(ValueError, match="3 KV heads"):
        check_shardable(three_kv_heads, 2, None)
    check_shardable(cfg, 8, None)  # 2 KV heads, 8 ranks: each KV head on 4 ranks
    wide = make_config("wide")  # 8 heads of 16: o_proj has 128 inputs, 64 per rank at TP 2
    with pytest.raises(ValueError, match="quantisation groups of 128"):
        check_shardable(wide, 2, AWQConfig(group_size=128))
    check_shardable(wide, 2, AWQConfig(group_size=64))
    with pytest.raises(ValueError, match="act order"):
        check_shardable(wide, 2, GPTQConfig(group_size=32, desc_act=True))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(tiny_model_factory("gqa"), tensor_parallel_size=0)


def test_cli_flags():
    for argv in (["-tp", "2"], ["--tensor-parallel-size", "2"]):
        assert engine_args_from(build_parser().parse_args(["serve", *argv])).tensor_parallel_size == 2
    assert engine_args_from(build_parser().parse_args(["serve"])).tensor_parallel_size == 1


SWEEP = ["mha", "gqa", "tied", "llama3_rope", "qwen2", "qwen2_mqa", "qwen3", "phi3", "mistral_sliding", "gemma2",
         "gemma3", "mixtral", "qwen3_moe"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("config", ["default", "stress"])
@pytest.mark.parametrize("variant", SWEEP)
def test_tp2_sweep(tiny_model_factory, variant, config):
    path = tiny_model_factory(variant)
    prompts = prompts_for()
    llm = LLM(path, tensor_parallel_size=2, **ENGINE, **(STRESS if config == "stress" else {}))
    try:
        assert greedy(llm, prompts)[1] == hf_greedy(path, prompts, MAX_NEW)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_tp4_replicates_kv_heads(tiny_model_factory):
    """4 ranks, 2 KV heads: each KV head on two ranks."""
    path = tiny_model_factory("gqa")
    prompts = prompts_for(2)
    llm = LLM(path, tensor_parallel_size=4, **ENGINE, **STRESS)
    try:
        assert llm.engine.core.runner.model.layers[0].self_attn.num_kv_heads == 1
        assert greedy(llm, prompts)[1] == hf_greedy(path, prompts, MAX_NEW)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_server_sigterm_leaves_no_worker(tiny_model_factory):
    proc, _ = start_server("--model", tiny_model_factory("gqa"), *SERVER_FLAGS)
    workers = spawned_children(proc.pid)
    assert len(workers) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not alive(workers[0])


@pytest.mark.slow
def test_llm_raises_once_its_worker_is_killed(tiny_model_factory):
    llm = LLM(tiny_model_factory("gqa"), tensor_parallel_size=2, **ENGINE)
    os.kill(llm.engine.core.workers.pids[0], signal.SIGKILL)
    with pytest.raises(TensorParallelError, match="exited with code -9"):
        greedy(llm, prompts_for())


@pytest.mark.slow
def test_worker_exits_when_the_server_is_killed(tiny_model_factory):
    proc, _ = start_server("--model", tiny_model_factory("gqa"), *SERVER_FLAGS)
    workers = spawned_children(proc.pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while alive(workers[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(workers[0])
