"""Quantisation at run time: the checkpoint formats and the linear layers' methods (base.py: QuantizationConfig;
the method interface, LinearMethodBase, lives with the layer in aserve/layers/linear.py). The offline quantiser that
writes such checkpoints is aserve/quantize. See docs/quantization.md.

A new method adds its file here (a QuantizationConfig and a LinearMethodBase) and one line to QUANTIZATION_CONFIGS.
"""

from __future__ import annotations

from aserve.layers.quantization.awq import AWQConfig
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.compressed_tensors import CompressedTensorsConfig
from aserve.layers.quantization.fp8_config import Fp8Config
from aserve.layers.quantization.gptq import GPTQConfig
from aserve.layers.quantization.int8 import Int8Config

# a checkpoint's `quant_method` -> its config class
QUANTIZATION_CONFIGS: dict[str, type[QuantizationConfig]] = {
    "awq": AWQConfig,
    "compressed-tensors": CompressedTensorsConfig,
    "fp8": Fp8Config,
    "gptq": GPTQConfig,
}

# methods that quantise a 16-bit checkpoint when it loads (`--quantization NAME`)
ONLINE_QUANTIZATION: dict[str, type[QuantizationConfig]] = {
    "fp8": Fp8Config,
    "int8": Int8Config,
}


def get_quantization_config(hf_config) -> QuantizationConfig | None:
    """The quantisation of a loaded transformers config, or None for an unquantised model. Looks at
    `quantization_config` first, then for older AutoAWQ's quant_config.json or AutoGPTQ's quantize_config.json beside
    config.json."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        model_dir = getattr(hf_config, "name_or_path", "") or ""
        return AWQConfig.from_legacy_file(model_dir) or GPTQConfig.from_legacy_file(model_dir)
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    method = str(raw.get("quant_method", "")).lower()
    if method not in QUANTIZATION_CONFIGS:
        supported = ", ".join(repr(name) for name in QUANTIZATION_CONFIGS)
        raise ValueError(f"quantization method {method!r} is not supported (aserve runs {supported})")
    return QUANTIZATION_CONFIGS[method].from_config(raw)
