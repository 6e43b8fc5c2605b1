"""vLLM's engine arguments for what aserve does one way (aserve/fixed_engine_args.py), as vLLM scripts pass them: to
`LLM(...)` and as `aserve serve` flags. The values that mean what aserve does are accepted; others are refused at
start-up, naming the argument and its flag."""

import pytest
import torch

from aserve import LLM
from aserve.cli import build_parser, engine_args_from
from aserve.cli import main as cli_main

ACCEPTED = {"pipeline_parallel_size": 1, "data_parallel_size": 1, "disable_custom_all_reduce": True,
            "distributed_executor_backend": "mp", "max_seq_len_to_capture": 8192, "compilation_config": {"level": 3},
            "task": "generate", "runner": "auto", "limit_mm_per_prompt": {"image": 0, "video": {"count": 0}},
            "enable_lora": False, "enable_sleep_mode": False, "skip_tokenizer_init": False, "cpu_offload_gb": 0,
            "logprobs_mode": "raw_logprobs", "scheduling_policy": "fcfs", "download_dir": "/tmp/hf",
            "model_impl": "vllm", "config_format": "hf", "code_revision": "main", "disable_sliding_window": False,
            "disable_cascade_attn": True, "calculate_kv_scales": False, "enable_expert_parallel": False,
            "kv_transfer_config": None, "mm_processor_kwargs": {}, "hf_token": "hf_x",
            "max_parallel_loading_workers": 2, "max_num_partial_prefills": 1, "max_long_partial_prefills": 1,
            "kv_events_config": None, "disable_hybrid_kv_cache_manager": False, "kv_sharing_fast_prefill": False,
            "kv_offloading_size": None, "enable_eplb": False}  # fmt: skip

REFUSED = [
    ({"pipeline_parallel_size": 2}, "tensor parallelism only"), ({"data_parallel_size": 2}, "one engine per server"),
    ({"distributed_executor_backend": "ray"}, "no Ray"), ({"distributed_executor_backend": "uni",
                                                          "tensor_parallel_size": 2}, "cannot split the model 2 ways"),
    ({"compilation_config": {"level": 3, "cudagraph_capture_sizes": [1]}}, "takes a level only"),
    ({"compilation_config": 1}, "takes a level only"), ({"task": "embed"}, "generative models only"),
    ({"runner": "pooling"}, "generative models only"), ({"limit_mm_per_prompt": {"image": 1}}, "text only"),
    ({"enable_lora": True}, "no LoRA"), ({"enable_sleep_mode": True}, "no sleep"),
    ({"skip_tokenizer_init": True}, "detokenises every output"), ({"cpu_offload_gb": 4}, "no CPU offload"),
    ({"logprobs_mode": "processed_logprobs"}, "raw_logprobs"), ({"scheduling_policy": "priority"}, "first come"),
    ({"max_seq_len_to_capture": 0}, "a length >= 1"),
    ({"model_impl": "transformers"}, "aserve's own model code"), ({"config_format": "mistral"}, "config.json"),
    ({"disable_sliding_window": True}, "within their windows"), ({"calculate_kv_scales": True}, "computes none"),
    ({"enable_expert_parallel": True}, "by tensor parallelism"),
    ({"kv_transfer_config": {"kv_connector": "NixlConnector"}}, "no disaggregated prefill"),
    ({"mm_processor_kwargs": {"num_crops": 4}}, "text only"), ({"max_parallel_loading_workers": 0}, "at least 1"),
    ({"max_num_partial_prefills": 4}, "vLLM v1 schedules"), ({"max_long_partial_prefills": 2}, "long prompts"),
    ({"kv_events_config": {"enable_kv_cache_events": True}}, "no KV cache events"),
    ({"disable_hybrid_kv_cache_manager": True}, "a block table per kind"),
    ({"kv_sharing_fast_prefill": True}, "its own KV"), ({"kv_offloading_size": 8.0}, "no CPU offloading"),
    ({"enable_eplb": True}, "no expert-parallel load balancing"),
]  # fmt: skip


def test_llm_takes_the_values_that_mean_what_aserve_does(tiny_model):
    llm = LLM(tiny_model, dtype=torch.float32, max_model_len=128, **ACCEPTED)
    assert llm.engine.config.args.enforce_eager is False  # level 3: aserve's default
    # compilation level 0 (vLLM's "no compilation, no CUDA graphs") is enforce_eager
    eager = LLM(tiny_model, dtype=torch.float32, max_model_len=128, compilation_config=0)
    assert eager.engine.config.args.enforce_eager


@pytest.mark.parametrize("kwargs, message", REFUSED)
def test_llm_refuses_other_values(tiny_model, kwargs, message):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name}=.*--{name.replace('_', '-')}.* is not supported: .*{message}"):
        LLM(tiny_model, dtype=torch.float32, max_model_len=128, **kwargs)


def test_serve_flags(tiny_model, capsys):
    argv = ["serve", tiny_model, "-pp", "1", "--data-parallel-size", "1", "--disable-custom-all-reduce",
            "--distributed-executor-backend", "uni", "--max-seq-len-to-capture", "4096", "--compilation-config", "3",
            "--task", "auto", "--runner", "generate", "--limit-mm-per-prompt", '{"image": 0}', "--no-enable-lora",
            "--cpu-offload-gb", "0", "--logprobs-mode", "raw_logprobs", "--scheduling-policy", "fcfs",
            "--download-dir", "/tmp/hf", "--trust-remote-code", "--swap-space", "4", "--tokenizer-mode", "auto",
            "--enable-chunked-prefill", "--model-impl", "auto", "--config-format", "auto", "--code-revision", "v1",
            "--disable-cascade-attn", "--no-disable-sliding-window", "--no-calculate-kv-scales",
            "--no-enable-expert-parallel", "--mm-processor-kwargs", "{}", "--max-parallel-loading-workers", "4",
            "--hf-token", "--max-num-partial-prefills", "1", "--max-long-partial-prefills", "1",
            "--no-disable-hybrid-kv-cache-manager", "--no-kv-sharing-fast-prefill", "--no-enable-eplb"]  # fmt: skip
    args = engine_args_from(build_parser().parse_args(argv))
    args.validate()
    assert (args.compilation_config, args.limit_mm_per_prompt, args.download_dir) == (3, {"image": 0}, "/tmp/hf")
    for flags, message in ((["--enable-lora"], "enable_lora=True (--enable-lora)"),
                           (["--compilation-config", '{"level": 2}'], "(--compilation-config)"),
                           (["--no-enable-chunked-prefill"], "always chunks prompts"),
                           (["--runner", "pooling"], "(--runner)"),
                           (["--kv-transfer-config", '{"kv_role": "kv_both"}'], "(--kv-transfer-config)"),
                           (["--enable-expert-parallel"], "(--enable-expert-parallel)"),
                           (["--kv-events-config", '{"publisher": "zmq"}'], "(--kv-events-config)"),
                           (["--max-num-partial-prefills", "2"], "(--max-num-partial-prefills)")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            cli_main(["serve", tiny_model, *flags])
        assert e.value.code == 2 and message in capsys.readouterr().err
