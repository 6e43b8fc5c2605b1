"""The AutoAWQ gemm format: packing against an independent, loop-by-loop re-implementation of AutoAWQ's packer,
round trips, group quantisation and config detection."""

import json

import pytest
import torch

from aserve.kernels.awq_reference import dequantize, unpack_int4
from aserve.layers.quantization import get_quantization_config
from aserve.layers.quantization.awq import AWQConfig
from aserve.layers.quantization.awq_format import fake_quantize, pack_int4, pack_linear, quantize_groups


def autoawq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM.from_linear packing, as written there: int [rows, cols] -> int32 [rows, cols / 8],
    nibble i of packed column j holding column 8j + order_map[i]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    return packed


def test_pack_matches_autoawq_packer_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (24, 40), generator=gen)
    assert torch.equal(pack_int4(values), autoawq_pack(values))


def test_pack_unpack_round_trip_including_sign_bit():
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(0, 16, (3, 5, 64), generator=gen)
    values[0, 0, :8] = 15  # every nibble set: the int32 is -1
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, 8)
    assert packed[0, 0, 0].item() == -1
    assert torch.equal(unpack_int4(packed), values.to(torch.int32))


def test_one_int32_layout():
    # column c of an 8-column group holds value c: nibbles (low to high) read columns 0, 2, 4, 6, 1, 3, 5, 7
    packed = pack_int4(torch.arange(8).view(1, 8))
    assert packed.item() == 0x75316420


def test_quantize_groups_bounds_and_error():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 128, generator=gen)
    w[3, :32] = w[3, :32].abs() + 0.5  # a one-signed group: 0 stays inside the grid, nothing is clipped
    q, z, s = quantize_groups(w, 32)
    assert q.min() >= 0 and q.max() <= 15 and z.min() >= 0 and z.max() <= 15
    assert s.dtype == torch.float16 and s.shape == (16, 4)
    deq = fake_quantize(w, 32)
    step = s.float().repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()  # round to nearest: at most half a step off


def test_pack_linear_dequantizes_to_fake_quantize():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 192, generator=gen)  # out 48 = 6 int32 columns; 3 groups of 64
    packed = pack_linear(w, 64)
    assert packed["qweight"].shape == (192, 6) and packed["qzeros"].shape == (3, 6)
    assert packed["scales"].shape == (3, 48)
    deq = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], 64)  # [in, out]
    assert torch.equal(deq.t(), fake_quantize(w, 64))


def test_pack_linear_rejects_shapes():
    with pytest.raises(ValueError, match="multiple of group_size"):
        pack_linear(torch.zeros(8, 96), 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_linear(torch.zeros(12, 64), 64)


def test_config_from_quantization_config_and_legacy_file(tmp_path):
    from transformers import AutoConfig, LlamaConfig

    cfg = LlamaConfig()
    assert get_quantization_config(cfg) is None
    cfg.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                               "version": "gemm", "modules_to_not_convert": ["down_proj"]}  # fmt: skip
    parsed = get_quantization_config(cfg)
    assert parsed == AWQConfig(group_size=64, modules_to_not_convert=("down_proj",))
    assert not parsed.converts("model.layers.0.mlp.down_proj") and parsed.converts("model.layers.0.mlp.up_proj")
    assert AWQConfig.from_config(parsed.to_hf()) == parsed

    cfg.save_pretrained(tmp_path)  # legacy AutoAWQ: quant_config.json beside a config without the entry
    config_json = json.loads((tmp_path / "config.json").read_text())
    config_json.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    (tmp_path / "quant_config.json").write_text(
        json.dumps({"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"})
    )
    legacy = AutoConfig.from_pretrained(tmp_path)  # as the engine loads it (AutoConfig records the directory)
    assert get_quantization_config(legacy) == AWQConfig(group_size=128)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "8-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv' is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
        ({"quant_method": "awq", "bits": 4, "group_size": 100}, "group_size 100"),
    ],
)
def test_unsupported_configs_name_the_problem(raw, message):
    from transformers import LlamaConfig

    cfg = LlamaConfig()
    cfg.quantization_config = raw
    with pytest.raises(ValueError, match=message):
        get_quantization_config(cfg)
