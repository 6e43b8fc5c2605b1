"""`aserve quantize`: a model directory (or .gguf, or the default model) -> an int4 checkpoint in the AutoAWQ format
(or, `--format gptq`, the GPTQ one).

    aserve quantize --model M --out DIR [--group-size 64] [--method gptq|awq-gptq|awq|rtn] [--calib FILE]
        [--format awq|gptq]

The output is a plain HF directory (config.json with `quantization_config`, model.safetensors, tokenizer) that
aserve loads, and so does any engine that reads AutoAWQ "gemm" (or GPTQ) checkpoints. The format is only the
packing: both hold the same grids (a GPTQ checkpoint from here has its groups in input order, desc_act false, and
is in format v1 unless a zero point is 0, which only v2 stores). Layer by layer: the calibration
activations go through the float layer, AWQ scales and clips its weights (awq_search.py) and/or GPTQ rounds them
with error feedback (gptq.py), the weights are packed, and the float layer's output becomes the next layer's input
(as AutoAWQ does; `sequential` takes the quantised layer's instead, as GPTQ does).

    rtn       round-to-nearest on each group's min/max grid, no calibration
    awq       AWQ scales (folded into the norm / linear before), clipping search, round-to-nearest
    gptq      GPTQ, each group's grid from a clipping search against the linear's Hessian, input channels by
              decreasing activation energy (act order; --no-act-order: in order); the default, lowest perplexity on
              SmolLM2 (docs/quantization.md)
    awq-gptq  AWQ scales, then GPTQ on the scaled weights (its grid search replaces AWQ's clipping)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import time
from importlib import resources

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from aserve.config import resolve_device
from aserve.entrypoints.llm import LLM
from aserve.kernels.awq_reference import unpack_int4
from aserve.layers.quantization.awq import AWQConfig
from aserve.layers.quantization.awq_format import fake_quantize, pack_linear, pack_quantized
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.gptq import GPTQConfig
from aserve.layers.quantization.gptq_format import from_awq
from aserve.models.loader import iterate_safetensors
from aserve.models.model_path import resolve_model
from aserve.quantize.awq_search import awq_layer
from aserve.quantize.dense_layer import DenseDecoderLayer
from aserve.quantize.gptq import dequantize, gptq_layer, gptq_quantize, gram, output_error
from aserve.quantize.tune import tune_end_to_end
from aserve.sampling_params import SamplingParams

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")  # fmt: skip
_SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
METHODS = ("gptq", "awq-gptq", "awq", "rtn")
FORMATS = ("awq", "gptq")


def data_path(name: str) -> str:
    """Text shipped with aserve: calibration.txt (AWQ calibration) or heldout.txt (perplexity); see
    docs/quantization.md for their source."""
    return str(resources.files("aserve.quantize") / "data" / name)


def calibration_ids(tokenizer, text: str, num_samples: int, seq_len: int) -> torch.Tensor:
    """-> [N, seq_len] token ids: consecutive windows of the text, spread evenly over it."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    available = ids.numel() // seq_len
    if available == 0:
        raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than one sample of {seq_len}")
    picks = torch.linspace(0, available - 1, min(num_samples, available)).round().long().unique()
    return torch.stack([ids[i * seq_len : (i + 1) * seq_len] for i in picks.tolist()])


def self_generated_windows(model_dir: str, calibration: torch.Tensor, count: int, progress: bool = True,
                           prefix: int = 32, seed: int = 0, device: str = "auto") -> torch.Tensor:  # fmt: skip
    """`count` windows as long as the calibration windows [N, seq_len], written by the float model itself through
    aserve's offline engine (temperature 1, ignoring EOS), each continuing the first `prefix` tokens of a
    calibration window (cycled; seeds seed, seed + 1, ...): more text for end-to-end tuning than the shipped
    calibration text holds, from the distribution the quantised model should match (SmolLM2 g64, 500 tuning steps
    of 8 windows: with 1000 such windows +5.2 % held-out perplexity, with 2000 +4.4 %; docs/quantization.md).
    Runs on `device` (auto: a GPU if there is one). -> [count, seq_len] token ids."""
    seq_len = calibration.shape[1]
    prefix = min(prefix, seq_len - 1)
    on_gpu = resolve_device(device).type == "cuda"
    llm = LLM(model_dir, max_model_len=seq_len, max_num_seqs=min(count, 256 if on_gpu else 64), device=device)
    prompts = [{"prompt_token_ids": calibration[i % len(calibration), :prefix].tolist()} for i in range(count)]
    params = [SamplingParams(temperature=1.0, max_tokens=seq_len - prefix, ignore_eos=True, seed=seed + i)
              for i in range(count)]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=progress)
    ids = torch.tensor([p["prompt_token_ids"] + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)])
    del llm, outs
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()  # the engine's KV cache, back to the device for the tuning (or other processes)
    return ids.to(calibration.dtype)


def quantize_model(
    model: str | None,
    out_dir: str,
    group_size: int = 64,
    method: str = "gptq",
    calib: str | None = None,
    num_samples: int = 16,
    seq_len: int = 512,
    n_grid: int = 20,
    clip: bool = True,
    progress: bool = True,
    sequential: bool = False,
    gptq_search: str = "weighted",
    act_order: bool = True,
    tune_steps: int = 0,
    tune_lr: float = 1e-3,
    tune_codes_lr: float = 0.0,
    tune_generated: int = 0,
    tune_batch: int = 2,
    device: str = "auto",
    fmt: str = "awq",
    quantize_lm_head: bool = False,
) -> dict:
    """Writes the quantised checkpoint to out_dir. -> a report {"layers": [{group: {"rtn", "awq"}}], "linears":
    [{linear: {"rtn", "gptq"}}], "seconds"} (per layer: AWQ's block errors, GPTQ's linear output errors).
    `sequential`: each layer calibrates on the outputs of the already quantised layers before it, instead of the
    float model's (AutoAWQ's way). `clip`: AWQ's clipping search, or GPTQ's search for each group's grid (else
    its min/max); `gptq_search` says which error that search minimises (gptq.SEARCHES); `act_order`: GPTQ rounds
    the input channels by decreasing activation energy (grids fixed beforehand), else in order. `tune_steps` > 0:
    then train the group scales and norms (and, with `tune_codes_lr` > 0, the codes) end to end against the float
    model on all the calibration text's windows (tune.py; report["tune"]), plus `tune_generated` windows the
    float model writes itself (self_generated_windows); `tune_batch` windows per step. `device` (auto: a GPU if
    there is one) runs all of it: calibration forwards, rounding, self-generation and tuning; the checkpoint's
    tensors come back to the CPU. `fmt`: the checkpoint format, awq or gptq (FORMATS). `quantize_lm_head` (GPTQ
    format only: GPTQModel's `"lm_head": true`): the head too, by GPTQ on the final norm's outputs (round-to-nearest
    with `rtn`), untied from the embedding, which stays 16-bit."""
    from transformers import AutoConfig, AutoTokenizer  # heavy: imported when a quantisation runs

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if quantize_lm_head and fmt != "gptq":
        raise ValueError("--quantize-lm-head needs --format gptq (AutoAWQ's format has no quantised lm_head)")
    if quantize_lm_head and tune_steps:
        raise ValueError(
            "--quantize-lm-head cannot be combined with --tune-steps (the tuning trains the final norm "
            "against the 16-bit head, which the int4 head's calibration would no longer match)"
        )
    for name, value, least in (("tune_steps", tune_steps, 0), ("tune_generated", tune_generated, 0),
                               ("tune_batch", tune_batch, 1), ("num_samples", num_samples, 1)):  # fmt: skip
        if value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    dev = resolve_device(device)  # before minutes of work: --device cuda on a machine without one fails here
    t0 = time.perf_counter()
    model_dir, _ = resolve_model(model)
    cfg = AutoConfig.from_pretrained(model_dir)
    arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in _SUPPORTED:
        raise ValueError(f"architecture {arch} cannot be quantised (supported: {', '.join(_SUPPORTED)})")
    if getattr(cfg, "quantization_config", None) is not None:
        raise ValueError(f"{model_dir!r} is already quantised; start from the float model")
    for what, size in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size)):
        if size % group_size:
            fits = [g for g in (128, 64, 32) if size % g == 0 and cfg.hidden_size % g == 0]
            raise ValueError(f"{what} {size} is not a multiple of group size {group_size}; use --group-size "
                             f"{fits[0] if fits else 32}")  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    state = dict(iterate_safetensors(model_dir))
    num_layers = cfg.num_hidden_layers

    x = None
    if method != "rtn" or tune_steps:
        with open(calib or data_path("calibration.txt"), encoding="utf-8") as f:
            calib_text = f.read()
    if method != "rtn":
        ids = calibration_ids(tokenizer, calib_text, num_samples, seq_len)
        seq_len = ids.shape[1]
        x = state["model.embed_tokens.weight"].to(dev, torch.float32)[ids.flatten().to(dev)]  # [N * seq_len, hidden]

    out: dict[str, torch.Tensor] = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
    report = {"layers": [], "linears": [], "method": method, "group_size": group_size}
    layers = range(num_layers)
    if progress:
        layers = tqdm(layers, desc=f"{method.upper()} int4 g{group_size}", unit="layer")
    for i in layers:
        prefix = f"model.layers.{i}."
        stored = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        weights = {k: v.to(dev, torch.float32) for k, v in stored.items()}
        grids = {}  # GPTQ's (q, z, s) per linear; the others are rounded to nearest when packed
        if x is not None:
            layer = DenseDecoderLayer(weights, cfg, seq_len)
            if method != "gptq" or not sequential:  # AWQ's inputs, or the float stream the next layer takes
                x_float, feats = layer.forward(x, seq_len)
            if method in ("awq", "awq-gptq"):
                report["layers"].append(awq_layer(layer, feats, seq_len, group_size, n_grid, clip and method == "awq"))
            feats = None
            if method in ("gptq", "awq-gptq"):  # layer.w's linears become their dequantised weights
                search = gptq_search if clip else "minmax"
                x_quantised, grids, errors = gptq_layer(layer, x, seq_len, group_size, search, act_order=act_order)
                report["linears"].append(errors)
            elif sequential:
                quantised = {k: fake_quantize(v, group_size) if k.removesuffix(".weight") in LINEARS else v
                             for k, v in layer.w.items()}  # fmt: skip
                x_quantised, _ = DenseDecoderLayer(quantised, cfg, seq_len).forward(x, seq_len)
            x = x_quantised if sequential else x_float
        for name in LINEARS:
            weight = weights.pop(f"{name}.weight")
            packed = pack_quantized(*grids[name]) if name in grids else pack_linear(weight, group_size)
            for key, tensor in packed.items():
                out[f"{prefix}{name}.{key}"] = tensor.cpu()
            if f"{name}.bias" in weights:
                out[f"{prefix}{name}.bias"] = weights.pop(f"{name}.bias").to("cpu", stored[f"{name}.bias"].dtype)
        for key, tensor in weights.items():  # norms (with AWQ scales folded in)
            out[prefix + key] = tensor.to("cpu", stored[key].dtype)
    if quantize_lm_head:
        report["lm_head"] = quantize_head(state, out, cfg, x, group_size, gptq_search if clip else "minmax",
                                          act_order)  # fmt: skip
    if tune_steps:
        windows = calibration_ids(tokenizer, calib_text, 1 << 30, seq_len)
        if tune_generated:
            generated = self_generated_windows(model_dir, windows, tune_generated, progress, device=device)
            windows = torch.cat([windows, generated])
        report["tune"] = tune_end_to_end(state, out, cfg, LINEARS, windows, group_size, tune_steps, tune_lr,
                                         batch_size=tune_batch, progress=progress, codes_lr=tune_codes_lr,
                                         device=dev)  # fmt: skip
        report["tune"].update(windows=len(windows), generated=tune_generated, batch=tune_batch)
    config = AWQConfig(group_size=group_size)
    if fmt == "gptq":
        out, config = gptq_tensors(out, group_size)
        config = dataclasses.replace(config, lm_head=quantize_lm_head)
    write_checkpoint(model_dir, out_dir, out, config, tokenizer, untie=quantize_lm_head)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def gptq_tensors(tensors: dict, group_size: int) -> tuple[dict, GPTQConfig]:
    """Every linear's AutoAWQ tensors -> its GPTQ tensors (gptq_format.from_awq), and the config: format v1 unless
    a zero point is 0 somewhere (then v2, which stores it)."""
    linears = [name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")]
    version = 1 if all(bool((unpack_int4(tensors[f"{m}.qzeros"]) > 0).all()) for m in linears) else 2
    out = {k: v for k, v in tensors.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}
    for m in linears:
        packed = from_awq(tensors[f"{m}.qweight"], tensors[f"{m}.qzeros"], tensors[f"{m}.scales"], version)
        out.update({f"{m}.{key}": t for key, t in packed.items()})
    fmt = "gptq" if version == 1 else "gptq_v2"
    return out, GPTQConfig(group_size=group_size, desc_act=False, sym=False, checkpoint_format=fmt)


def quantize_head(state: dict, out: dict, cfg, x: torch.Tensor | None, group_size: int, search: str,
                  act_order: bool) -> dict[str, float]:  # fmt: skip
    """The lm_head (or the tied embedding's table) as int4 into `out` (AutoAWQ tensors, lm_head.*): GPTQ on the
    final norm of the residual stream `x` [T, hidden] leaving the last layer, or round-to-nearest without one.
    -> its output errors on those inputs {"rtn", "gptq"} (empty without x)."""
    w = state.get("lm_head.weight", state["model.embed_tokens.weight"]).to(torch.float32)
    if x is None:
        packed, errors = pack_linear(w, group_size), {}
    else:
        w = w.to(x.device)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        h = gram(normed * state["model.norm.weight"].to(x.device, torch.float32))
        grid = gptq_quantize(w, h, group_size, search, act_order=act_order)
        errors = {"rtn": output_error(w, fake_quantize(w, group_size), h),
                  "gptq": output_error(w, dequantize(*grid), h)}  # fmt: skip
        packed = pack_quantized(*grid)
    out.update({f"lm_head.{key}": tensor.cpu() for key, tensor in packed.items()})
    out.pop("lm_head.weight", None)
    return errors


def write_checkpoint(src_dir: str, out_dir: str, tensors: dict, config: QuantizationConfig, tokenizer,
                     untie: bool = False) -> None:  # fmt: skip
    """`untie`: the head has tensors of its own (a quantised head beside a tied 16-bit embedding)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(src_dir, "config.json")) as f:
        hf_config = json.load(f)
    hf_config["quantization_config"] = config.to_hf()
    if untie:
        hf_config["tie_word_embeddings"] = False
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(src_dir, extra)):
            shutil.copy(os.path.join(src_dir, extra), out_dir)


# -- the CLI (registered by aserve/cli.py) ------------------------------------------------------------------------


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="quantise a model to int4 (AutoAWQ gemm format, or GPTQ's)")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--out", required=True, help="output directory (an HF model directory)")
    p.add_argument("--group-size", type=int, default=64, help="inputs per scale / zero point: 32, 64 or 128")
    p.add_argument(
        "--method",
        choices=METHODS,
        default="gptq",
        help="gptq (error feedback, by decreasing activation energy), awq-gptq (AWQ scales, then GPTQ), "
        "awq (scales + clipping), or rtn (round-to-nearest)",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="awq",
        help="checkpoint format: awq (AutoAWQ gemm) or gptq "
        "(AutoGPTQ / GPTQModel: groups in input order, desc_act false)",
    )
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="with --format gptq, quantise the lm_head too (GPTQ on the final norm's outputs; GPTQModel's "
        '"lm_head": true); the embedding stays 16-bit',
    )
    p.add_argument("--calib", default=None, help="calibration text file (default: the text shipped with aserve)")
    p.add_argument("--num-samples", type=int, default=16, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--no-clip", action="store_true", help="skip the clipping search (AWQ's, or GPTQ's grid search)")
    p.add_argument(
        "--no-act-order",
        action="store_true",
        help="GPTQ rounds input channels in order (default: by decreasing activation energy)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="calibrate each layer on the quantised model's activations, not the float model's",
    )
    p.add_argument(
        "--tune-steps",
        type=int,
        default=0,
        help="after rounding, train the group scales and norms end to end against the float model for "
        "this many steps of --tune-batch calibration windows (0: off; SmolLM2-135M, 2 windows: "
        "~8 s per step on 2 CPU cores)",
    )
    p.add_argument(
        "--tune-lr",
        type=float,
        default=1e-3,
        help="Adam learning rate of --tune-steps for the scales and norms (cosine schedule)",
    )
    p.add_argument(
        "--tune-codes-lr",
        type=float,
        default=0.0,
        help="with --tune-steps, also move 4-bit codes (straight-through), at this learning rate; 0: off",
    )
    p.add_argument(
        "--tune-generated",
        type=int,
        default=0,
        help="with --tune-steps, also tune on this many windows the float model writes itself "
        "(temperature 1, each continuing a calibration window's first 32 tokens); 0: off",
    )
    p.add_argument("--tune-batch", type=int, default=2, help="calibration windows per --tune-steps step")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="where calibration, rounding and --tune-steps / --tune-generated run (auto: the GPU if there is one)",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")


def run_quantize(ns: argparse.Namespace) -> None:
    report = quantize_model(ns.model, ns.out, ns.group_size, ns.method, ns.calib, ns.num_samples, ns.seq_len,
                            clip=not ns.no_clip, sequential=ns.sequential, act_order=not ns.no_act_order,
                            tune_steps=ns.tune_steps, tune_lr=ns.tune_lr, tune_codes_lr=ns.tune_codes_lr,
                            tune_generated=ns.tune_generated, tune_batch=ns.tune_batch, device=ns.device,
                            fmt=ns.format, quantize_lm_head=ns.quantize_lm_head)  # fmt: skip
    print(
        f"aserve: wrote {ns.method.upper()} int4 (group {ns.group_size}, {ns.format.upper()} format) to {ns.out} "
        f"in {report['seconds']} s"
    )
    if report["layers"]:
        rtn = sum(sum(g["rtn"] for g in layer.values()) for layer in report["layers"])
        awq = sum(sum(g["awq"] for g in layer.values()) for layer in report["layers"])
        print(f"aserve: calibration block error, summed over layers: RTN {rtn:.4g} -> AWQ scales {awq:.4g}")
    if report["linears"]:
        rtn = sum(sum(e["rtn"] for e in layer.values()) for layer in report["linears"])
        gptq = sum(sum(e["gptq"] for e in layer.values()) for layer in report["linears"])
        print(f"aserve: calibration linear output error, summed over linears: RTN {rtn:.4g} -> GPTQ {gptq:.4g}")
    if report.get("lm_head"):
        head = report["lm_head"]
        print(f"aserve: lm_head calibration output error: RTN {head['rtn']:.4g} -> GPTQ {head['gptq']:.4g}")
    if "tune" in report:
        tune = report["tune"]
        print(
            f"aserve: end-to-end tuning, {tune['steps']} steps in {tune['seconds']} s: KL per token to the float "
            f"model {tune['kl_before']:.4g} -> {tune['kl_after']:.4g}, {tune['codes_changed']} codes moved; "
            f"{tune['windows']} windows ({tune['generated']} self-generated), {tune['batch']} per step"
        )
