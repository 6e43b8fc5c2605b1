"""8-bit GPTQ checkpoints (bits 8, group_size -1) on the int8 weight-only path: aserve's greedy tokens equal
transformers' on the float checkpoint of the dequantised weights; what the int8 kernels cannot hold is refused.

The checkpoints come from a writer in this file, independent of aserve: GPTQ's 8-bit grid per output channel
(symmetric: scale = 2 max|w| / 255, zero point 128; asymmetric: min/max), AutoGPTQ's packing of 4 values per int32
(qweight along the input dimension, qzeros along the output dimension), format v1 (zero points minus one) or v2."""

import os

import pytest
import torch
from safetensors.torch import load_file
from test_awq_model import LINEARS, MAX_NEW, PROMPTS, aserve_greedy, copy_model_dir
from tiny_models import hf_greedy

from aserve import LLM
from aserve.layers.linear import Linear
from aserve.layers.quantization.int8 import Int8LinearMethod


def pack_rows8(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 255] -> int32 [R/4, C]: rows 4i + j in bits 8j of row i (AutoGPTQ's pack, bits 8)."""
    packed = torch.zeros(values.shape[0] // 4, values.shape[1], dtype=torch.int64)
    for i in range(values.shape[0] // 4):
        for j in range(4):
            packed[i] |= values[4 * i + j].to(torch.int64) << (8 * j)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize8(w: torch.Tensor, sym: bool):
    """W [N, K] -> (q [K, N] in 0..255, z [N], s fp16 [N]) on one grid per output channel."""
    w = w.float()
    lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    if sym:
        s = (2 * torch.maximum(-lo, hi) / 255).clamp(min=1e-6).half()
        z = torch.full((w.shape[0],), 128)
    else:
        s = ((hi - lo) / 255).clamp(min=1e-6).half()
        z = (-lo / s.float()).round().clamp(1, 255).long()
    q = (w / s.float()[:, None]).round().add(z[:, None]).clamp(0, 255).long()
    return q.t(), z, s


def gptq8_checkpoint(float_dir: str, out_dir: str, sym: bool, version: int, desc_act: bool = False) -> tuple:
    """-> (8-bit GPTQ dir, dir of the float checkpoint of its dequantised weights)."""
    tensors, dequantized = {}, {}
    for name, w in load_file(os.path.join(float_dir, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.split(".")[-1] in LINEARS):
            tensors[name] = dequantized[name] = w
            continue
        q, z, s = quantize8(w, sym)
        tensors[f"{module}.qweight"] = pack_rows8(q)
        tensors[f"{module}.qzeros"] = pack_rows8((z - (1 if version == 1 else 0))[:, None]).t().contiguous()
        tensors[f"{module}.scales"] = s[None, :]
        tensors[f"{module}.g_idx"] = torch.zeros(w.shape[1], dtype=torch.int32)
        dequantized[name] = ((q - z[None, :]).float() * s.float()[None, :]).t().contiguous()
    config = {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq" if version == 1 else "gptq_v2"}  # fmt: skip
    return (copy_model_dir(float_dir, out_dir, tensors, config),
            copy_model_dir(float_dir, out_dir + "-deq", dequantized, None))  # fmt: skip


@pytest.mark.parametrize("variant, version, desc_act", [("gqa", 1, False), ("qwen2", 2, True)])
def test_8bit_gptq_runs_on_the_int8_path_and_matches_transformers(tiny_model_factory, tmp_path, variant, version,
                                                                  desc_act):  # fmt: skip
    gptq_dir, deq_dir = gptq8_checkpoint(tiny_model_factory(variant), str(tmp_path / "gptq8"), True, version, desc_act)
    llm = LLM(gptq_dir, dtype="float32", enforce_eager=True, max_model_len=256, quantization="gptq")
    linears = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Linear) and m.out_features != 384]
    assert linears and all(isinstance(m.quant_method, Int8LinearMethod) for m in linears)
    assert all(m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32 for m in linears)
    del llm
    assert aserve_greedy(gptq_dir) == hf_greedy(deq_dir, PROMPTS, MAX_NEW)


def test_what_the_int8_kernels_cannot_hold_is_refused(tiny_model_factory, tmp_path):
    float_dir = tiny_model_factory("gqa")
    asym_dir, _ = gptq8_checkpoint(float_dir, str(tmp_path / "asym"), False, 2)
    with pytest.raises(ValueError, match=r"8-bit GPTQ layer \[\d+ x \d+\]: q - zero point does not fit int8"):
        LLM(asym_dir, dtype="float32", enforce_eager=True, max_model_len=256)
    grouped_dir, _ = gptq8_checkpoint(float_dir, str(tmp_path / "grouped"), True, 2)
    config_path = os.path.join(grouped_dir, "config.json")
    with open(config_path) as f:
        text = f.read().replace('"group_size": -1', '"group_size": 128')
    with open(config_path, "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match="8-bit GPTQ with group_size 128: not supported"):
        LLM(grouped_dir, enforce_eager=True)
