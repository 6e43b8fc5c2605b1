"""Building a model and loading its weights: safetensors checkpoints, or random weights at real shapes
(`load_format="dummy"`)."""

from __future__ import annotations

import torch
from safetensors import safe_open
from tqdm import tqdm

from aserve import envs
from aserve.layers.batch_invariant import select_batch_invariant_ops, use_batch_invariant_linears
from aserve.layers.elementwise import select_elementwise_ops
from aserve.layers.quantization import ONLINE_QUANTIZATION, QUANTIZATION_CONFIGS, get_quantization_config
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.lm_head import quantize_lm_head as quantize_lm_head_of
from aserve.layers.quantization.lm_head import use_checkpoint_head
from aserve.models import vision_language
from aserve.models.model_path import checkpoint_files
from aserve.models.registry import get_model_class


def iterate_safetensors(model_dir: str, show_progress: bool = False):
    files = checkpoint_files(model_dir)
    progress = None
    if show_progress:
        progress = tqdm(total=len(files), desc="Loading safetensors shards", leave=False, disable=None)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()


def build_model(
    hf_config,
    model_dir: str,
    dtype,
    device,
    max_model_len: int,
    backend,
    load_format: str,
    seed: int,
    compile_model: bool = False,
    quantization: str | None = None,
    shard=None,
    deterministic: bool = False,
    quantize_lm_head: bool = False,
) -> torch.nn.Module:
    """Picks the element-wise implementation for the device (Triton kernels on GPU; C kernels, or torch.compile'd
    where they do not build, on CPU), constructs the architecture on the meta device with it, `backend` and every
    linear's quantisation method, materialises it on `device`, loads (or draws) weights and lets every layer prepare
    them for its kernels (process_weights_after_loading). `quantization` (the engine argument): what the checkpoint
    must be. `shard`: a transform that splits the model across ranks (tensor parallelism,
    aserve/distributed/sharding.py): `shard.apply(model)` on the model built on the meta device, and
    `shard.weights(tensors)` cuts every checkpoint tensor to this rank's slice as it loads. `deterministic`
    (deterministic mode): batch-invariant element-wise ops and linear methods (aserve/layers/batch_invariant.py).
    `quantize_lm_head`: the lm_head rounded at load by the method aserve/layers/quantization/lm_head.py picks for
    the model's quantisation."""
    model_class = get_model_class(hf_config)
    quant_config = resolve_quantization(quantization, get_quantization_config(hf_config), model_dir)
    if deterministic:
        ops = select_batch_invariant_ops(device, dtype)
    else:
        ops = select_elementwise_ops(device, dtype, compile_model)
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(hf_config, backend, ops, quant_config, max_position=max_model_len)
            if getattr(quant_config, "lm_head", False):
                if quantize_lm_head:
                    raise ValueError("--quantize-lm-head: this checkpoint's lm_head is quantised already")
                use_checkpoint_head(model, quant_config)
            elif quantize_lm_head:
                quantize_lm_head_of(model, quant_config)
            if shard is not None:
                shard.apply(model)
            if deterministic:
                use_batch_invariant_linears(model)
    finally:
        torch.set_default_dtype(default_dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.materialize(device)
    load_weights(model, model_dir, load_format, seed, show_progress=True, quant_config=quant_config, shard=shard,
                 text_side=vision_language.is_text_side(hf_config))  # fmt: skip
    model.eval()
    model.process_weights_after_loading()
    if device.type == "cuda":
        from aserve.kernels import pdl  # Triton: optional, imported where it runs

        torch.cuda.empty_cache()  # AWQ: the AutoAWQ tensors that repacking freed
        # Programmatic dependent launch of aserve's kernels (Hopper and newer; ASERVE_PDL=0: off, for A/B runs).
        pdl.enable(torch.cuda.get_device_capability(device)[0] >= 9 and envs.ASERVE_PDL)
    return model


# the checkpoint formats aserve writes itself, and how
_WRITTEN_BY = {
    "awq": "; quantise it with `aserve quantize`",
    "gptq": "; quantise it with `aserve quantize --format gptq`",
}


def resolve_quantization(
    quantization: str | None, quant_config: QuantizationConfig | None, model_dir: str
) -> QuantizationConfig | None:
    """The quantisation the model runs with. `--quantization awq` (or gptq) states what the checkpoint must be (as in
    vLLM; the method itself is read from the checkpoint); `--quantization fp8` (or int8) quantises a 16-bit
    checkpoint as it loads. Raises a clear error when the argument and the checkpoint disagree."""
    if quantization is None:
        return quant_config
    names = sorted({*QUANTIZATION_CONFIGS, *ONLINE_QUANTIZATION})
    if quantization not in names:
        raise ValueError(f"quantization must be one of {', '.join(names)} (or unset), got {quantization!r}")
    if quantization in ONLINE_QUANTIZATION and quant_config is None:
        return ONLINE_QUANTIZATION[quantization]()
    if quant_config is None or quant_config.name != quantization:
        found = "a 16-bit checkpoint" if quant_config is None else f"a checkpoint quantised with {quant_config.name}"
        hint = _WRITTEN_BY.get(quantization, "")
        raise ValueError(f"--quantization {quantization}, but {model_dir!r} is {found}{hint}")
    return quant_config


def load_weights(model: torch.nn.Module, model_dir: str, load_format: str, seed: int, show_progress: bool,
                 quant_config: QuantizationConfig | None = None, shard=None,
                 text_side: bool = False) -> None:  # fmt: skip
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        return
    if load_format != "auto":
        raise ValueError(f"load_format {load_format!r} is not supported (auto, dummy)")
    weights = iterate_safetensors(model_dir, show_progress)
    if text_side:  # a vision-language checkpoint: its language model's tensors
        weights = vision_language.language_model_weights(weights)
    if quant_config is not None:  # the format's own reshaping / checks of its tensors
        weights = quant_config.checkpoint_weights(weights)
    if shard is not None:  # tensor parallelism: this rank's slice of each tensor
        weights = shard.weights(weights)
    loaded = model.load_weights(weights)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks weights for: {sorted(missing)[:8]}")


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights at real shapes for benchmarks: N(0, 0.02) matrices, unit norms, zero biases (AWQ / GPTQ layers:
    random packed weights and zero points, scales that give weights of about the same size; GPTQ: groups in input
    order; FP8 checkpoints: e4m3 weights and scales that give the same, input scales 1)."""
    gen = None
    params = dict(model.named_parameters())
    for name, param in params.items():
        if gen is None or gen.device != param.device:
            gen = torch.Generator(device=param.device)
            gen.manual_seed(seed)
        if name.endswith(".g_idx"):  # GPTQ: contiguous groups, as many as the layer's scales have rows
            k, groups = param.numel(), params[name.removesuffix("g_idx") + "scales"].shape[0]
            param.copy_(torch.arange(k, device=param.device) // (k // groups))
        elif param.dtype == torch.float8_e4m3fn:  # FP8 checkpoints: e4m3 values ~N(0, 64), scales 1/3200 below
            param.copy_(torch.randn(param.shape, generator=gen, device=param.device).mul_(64).clamp_(-448, 448))
        elif name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale", ".w13_scale", ".w2_scale")):
            param.fill_(1.0 if name.endswith(".input_scale") else 0.02 / 64)
        elif not param.is_floating_point():  # packed int4 (AWQ / GPTQ qweight, qzeros): random nibbles
            param.random_(-(2**31), 2**31, generator=gen)
            if name.endswith(".qzeros") and name.removesuffix("qzeros") + "g_idx" in params:
                param.bitwise_and_(0x77777777)  # GPTQ: stored zero points 0-7 (a v1 15 would read as 16)
        elif param.dim() == 1:
            param.fill_(1.0 if "norm" in name else 0.0)
        elif name.endswith(".scales"):  # AWQ: q - z has a std of ~6.5, so weights come out at ~N(0, 0.02)
            param.normal_(0.0, 0.003, generator=gen).abs_()
        else:
            param.normal_(0.0, 0.02, generator=gen)
