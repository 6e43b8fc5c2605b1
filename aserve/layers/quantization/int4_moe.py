"""Int4 experts of a mixture-of-experts block (aserve/layers/moe.py) read from AWQ and GPTQ checkpoints, which store
each expert's gate, up and down projections as int4 linears in the layouts the linear layers load:

    AWQ    {module}.qweight int32 [in, out/8], .qzeros int32 [in/g, out/8], .scales fp16 [in/g, out]
           (aserve/kernels/awq_reference.py)
    GPTQ   {module}.qweight int32 [in/8, out], .qzeros int32 [G, out/8], .scales fp16 [G, out], .g_idx int32 [in]
           (aserve/layers/quantization/gptq_format.py)

with {module} e.g. model.layers.0.mlp.experts.3.gate_proj (Mixtral: ...block_sparse_moe.experts.3.w1). As soon as
all of a projection's tensors are in, it is converted into its rows of the block's packed stacks (one layout for both
formats, aserve/kernels/moe_int4_reference.py: int4 along K in int32 words, a uint8 zero point and an fp16 scale per
output row and group),

    w13 int32 [E, 2 I, H/8]   w13_qzeros uint8 / w13_scales fp16 [E, 2 I, H/g]
    w2  int32 [E, H, I/8]     w2_qzeros  uint8 / w2_scales  fp16 [E, H, I/g]

so loading holds the experts at about 4.2 bits per weight (g = 128), plus one projection's checkpoint tensors. What
runs is chosen once the weights are in (process_weights_after_loading), one log line saying which:

    CUDA (keeps_packed), group size a multiple of 64: the packed experts stay and the block runs the int4 Triton
        kernels of aserve/kernels/moe_int4.py (weight tiles dequantised in registers; the grouped GEMMs for many
        tokens, the few-token kernels otherwise)
    CPU (or a group size the kernels cannot tile): the experts dequantised into 16-bit stacks w13 [E, 2 I, H] /
        w2 [E, H, I] of the model's dtype, run by the unquantised experts' kernels (the CPU's C kernels need them):
        the experts then take 16-bit memory
    GPTQ act order (desc_act: each projection's groups scattered over its inputs by its own g_idx): the projections
        are dequantised into the 16-bit stacks as they load (GPTQ through gptq_format.to_awq, as its linears are
        repacked), on every device: no int4 kernel for experts reads an input order per projection, so these take
        16-bit memory (one log line says so)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn

from aserve.kernels import moe_int4_reference
from aserve.kernels.awq_reference import dequantize, unpack_int4
from aserve.kernels.moe_int4_reference import Int4Experts
from aserve.layers.moe import UnquantizedMoEMethod
from aserve.layers.quantization import gptq_format
from aserve.layers.quantization.awq_format import PACK_FACTOR

logger = logging.getLogger("aserve")

PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}
# (FusedMoE parameter, shard of w13) -> index of the projection in `expert_names` (gate, up, down)
_PROJECTION_INDEX = {("w13", 0): 0, ("w13", 1): 1, ("w2", None): 2}
# Group sizes the int4 kernels take: multiples of 64. Their grouped GEMM's K tile lies in one group, and with K tiles
# of 32 Triton 3.6 fails to compile it for sm_90 (float16, in TritonGPUOptimizeDotOperands; H200, 2026-12-03).
GROUP_MULTIPLE = 64
_logged: set[str] = set()


def _log_once(message: str, *args) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message, *args)


def keeps_packed(device: torch.device) -> bool:
    """Whether experts on `device` stay packed, run by the int4 Triton kernels (tests set it on a CPU, where
    Triton's interpreter runs them)."""
    return device.type == "cuda"


def packed_experts(layer: nn.Module) -> tuple[Int4Experts, Int4Experts]:
    """The block's packed stacks (w13, w2) as the int4 kernels take them."""
    return (Int4Experts(layer.w13, layer.w13_qzeros, layer.w13_scales),
            Int4Experts(layer.w2, layer.w2_qzeros, layer.w2_scales))  # fmt: skip


def int4_fused(layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The GPU kernel of packed experts (aserve/kernels/moe_int4.py, set on the layer by use_triton)."""
    return layer.triton_moe(x, router_logits, *packed_experts(layer), layer.top_k, layer.renormalize, layer.moe_config)


class Int4MoEMethod(UnquantizedMoEMethod):
    """`checkpoint_format`: awq | gptq; `group_size`: inputs per group (-1: all of a projection's inputs, GPTQ);
    `gptq_version`: 1 (zero points stored minus one) or 2; `expert_names`: the checkpoint's modules of expert 0's
    gate, up and down projections (errors name the checkpoint's tensors by them); `act_order`: GPTQ desc_act (the
    experts dequantised as they load). State on the layer while loading: `int4_parts` ((parameter, expert, shard) ->
    the projection's tensors in so far) and `int4_done` (the projections converted)."""

    def __init__(self, checkpoint_format: str, group_size: int, gptq_version: int = 1,
                 expert_names: Sequence[str] = (), act_order: bool = False) -> None:  # fmt: skip
        self.format, self.parts = checkpoint_format, PARTS[checkpoint_format]
        self.group_size, self.gptq_version = group_size, gptq_version
        self.expert_names = tuple(expert_names)
        self.act_order = act_order

    def _group(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def create_weights(self, layer: nn.Module, hidden_size: int) -> None:
        for in_features in (hidden_size, layer.intermediate_size):
            group = self._group(in_features)
            if in_features % group or in_features % PACK_FACTOR:
                raise ValueError(f"{self.format} experts: input size {in_features} is not a multiple of group_size "
                                 f"{group} and 8")  # fmt: skip
        if layer.intermediate_size % PACK_FACTOR or hidden_size % PACK_FACTOR:
            raise ValueError(f"{self.format} experts: output sizes {layer.intermediate_size} and {hidden_size} must "
                             "be multiples of 8")  # fmt: skip
        layer.int4_parts, layer.int4_done = {}, set()
        layer.params_dtype = torch.get_default_dtype()
        if self.act_order:
            super().create_weights(layer, hidden_size)  # the 16-bit stacks the projections are dequantised into
            return
        e, i = layer.num_experts, layer.intermediate_size
        for name, rows, in_features in (("w13", 2 * i, hidden_size), ("w2", hidden_size, i)):
            groups = in_features // self._group(in_features)
            setattr(layer, name, nn.Parameter(torch.empty(e, rows, in_features // PACK_FACTOR, dtype=torch.int32),
                                              requires_grad=False))  # fmt: skip
            layer.register_buffer(f"{name}_qzeros", torch.empty(e, rows, groups, dtype=torch.uint8), persistent=False)
            layer.register_buffer(f"{name}_scales", torch.empty(e, rows, groups, dtype=torch.float16),
                                  persistent=False)  # fmt: skip

    def checkpoint_name(self, param_name: str, expert: int, shard: int | None) -> str:
        """The checkpoint's module of expert `expert`'s projection (its gate, up or down)."""
        index = _PROJECTION_INDEX[(param_name, shard)]
        if index >= len(self.expert_names):
            return f"experts.{expert}.{('gate', 'up', 'down')[index]}"
        return self.expert_names[index].replace(".experts.0.", f".experts.{expert}.")

    def load_packed(self, layer: nn.Module, param_name: str, expert: int, shard: int | None, part: str,
                    tensor: torch.Tensor) -> bool:  # fmt: skip
        """One of a projection's int4 tensors (`part`: qweight, qzeros, scales or g_idx); once all are in, the
        projection is converted into its rows of the stacks (packed, or dequantised with act order). -> whether it
        was."""
        key = (param_name, expert, shard)
        if part not in self.parts:
            raise ValueError(f"{self.checkpoint_name(*key)}.{part}: not a tensor of {self.format} checkpoints")
        target = getattr(layer, param_name)
        parts = layer.int4_parts.setdefault(key, {})
        parts[part] = tensor.to(target.device)
        if len(parts) < len(self.parts):
            return False
        del layer.int4_parts[key]
        out_features = layer.intermediate_size if shard is not None else target.shape[1]
        in_features = target.shape[2] if self.act_order else target.shape[2] * PACK_FACTOR
        name = self.checkpoint_name(*key)
        self._check_shapes(parts, out_features, in_features, name)
        if self.act_order:
            layer.load_expert(target, expert, shard, self._dequantize(parts, in_features))
        else:
            qweight, qzeros, scales = self._pack(parts, in_features, name)
            layer.load_expert(target, expert, shard, qweight)
            layer.load_expert(getattr(layer, f"{param_name}_qzeros"), expert, shard, qzeros)
            layer.load_expert(getattr(layer, f"{param_name}_scales"), expert, shard, scales)
        layer.int4_done.add(key)
        return True

    def _check_shapes(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int, name: str) -> None:
        group = self._group(in_features)
        groups, packed = in_features // group, out_features // PACK_FACTOR
        expected = {"qzeros": (groups, packed), "scales": (groups, out_features), "g_idx": (in_features,),
                    "qweight": (in_features, packed) if self.format == "awq" else (in_features // PACK_FACTOR,
                                                                                   out_features)}  # fmt: skip
        for part, tensor in parts.items():
            if tuple(tensor.shape) != expected[part]:
                raise ValueError(f"{name}.{part}: checkpoint shape {tuple(tensor.shape)} != {expected[part]} "
                                 f"({self.format}, group_size {group})")  # fmt: skip

    def _pack(self, parts: dict[str, torch.Tensor], in_features: int, name: str):
        """-> one projection in the packed layout: (qweight int32 [out, in/8], qzeros uint8 [out, G], scales fp16
        [out, G])."""
        if self.format == "awq":
            q = moe_int4_reference.pack(unpack_int4(parts["qweight"]).t())
            z = unpack_int4(parts["qzeros"])
        else:
            if gptq_format.input_order(parts["g_idx"], self._group(in_features)) is not None:
                raise ValueError(f"{name}.g_idx: the inputs' groups are out of order, but the checkpoint's desc_act "
                                 "is false")  # fmt: skip
            q = parts["qweight"].t()  # GPTQ packs along the inputs as the layout does
            z = gptq_format.zero_points(parts["qzeros"], self.gptq_version)
            if (z > 15).any():
                raise ValueError(f"{name}.qzeros: GPTQ v1 zero point of 0, stored as -1 (AutoGPTQ's asymmetric "
                                 "overflow): not supported; write it in the v2 format (gptq_v2)")  # fmt: skip
        return q, z.t().to(torch.uint8), parts["scales"].t().half()

    def _dequantize(self, parts: dict[str, torch.Tensor], in_features: int):
        """-> W float32 [out, in] of one projection's (act-order GPTQ) tensors."""
        group = self._group(in_features)
        repacked = gptq_format.to_awq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], group,
                                      self.gptq_version)  # fmt: skip
        w = dequantize(repacked.qweight, repacked.qzeros, repacked.scales, group)  # inputs in input_perm's order
        if repacked.input_perm is not None:
            w = torch.empty_like(w).index_copy_(0, repacked.input_perm, w)
        return w.t()

    def missing_tensors(self, layer: nn.Module) -> list[str]:
        """The checkpoint tensors of projections not converted (named as the checkpoint names them)."""
        missing = []
        for expert in range(layer.num_experts):
            for param_name, shard in _PROJECTION_INDEX:
                key = (param_name, expert, shard)
                if key not in layer.int4_done:
                    have = layer.int4_parts.get(key, {})
                    missing += [f"{self.checkpoint_name(*key)}.{p}" for p in self.parts if p not in have]
        return missing

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.int4_parts = {}
        dtype = str(layer.params_dtype).removeprefix("torch.")
        if self.act_order:
            _log_once("gptq: act-order int4 experts dequantised to %s at load (no int4 kernel for experts reads "
                      "each projection's input order): they take 16-bit memory", dtype)  # fmt: skip
            return
        if layer.w13.dtype != torch.int32:  # prepared already
            return
        if not layer.int4_done:  # no checkpoint tensors came (load_format dummy: random packed weights only)
            _dummy_groups(layer)
        groups = (self._group(layer.w13.shape[2] * PACK_FACTOR), self._group(layer.w2.shape[2] * PACK_FACTOR))
        if keeps_packed(layer.w13.device) and all(g % GROUP_MULTIPLE == 0 for g in groups):
            _log_once(f"{self.format}: int4 experts kept packed on %s (int4 weights, a zero point and an fp16 scale "
                      "per group), run by the int4 Triton kernels", layer.w13.device.type)  # fmt: skip
            layer.use_triton()
            return
        reason = ("for the CPU's kernels" if layer.w13.device.type == "cpu"
                  else f"(group sizes {groups}: the int4 kernels need multiples of {GROUP_MULTIPLE})")  # fmt: skip
        _log_once(f"{self.format}: int4 experts dequantised to %s at load %s, run by the unquantised experts' "
                  "kernels: they take 16-bit memory", dtype, reason)  # fmt: skip
        for name, experts in zip(("w13", "w2"), packed_experts(layer)):
            setattr(layer, name, nn.Parameter(_dequantized(experts, layer.params_dtype), requires_grad=False))
            setattr(layer, f"{name}_qzeros", None)
            setattr(layer, f"{name}_scales", None)

    def use_triton(self, layer: nn.Module, config: dict | None = None, fixed_order_sum: bool = False) -> None:
        """Packed experts: the int4 kernels (aserve/kernels/moe_int4.py); dequantised ones: the 16-bit kernels."""
        if layer.w13.dtype != torch.int32:
            super().use_triton(layer, config, fixed_order_sum)
            return
        from aserve.kernels import moe_int4  # Triton: optional (CPU installs may lack it), imported once it is chosen

        fused = functools.partial(moe_int4.fused_moe, fixed_order_sum=True) if fixed_order_sum else moe_int4.fused_moe
        layer.kernel, layer.triton_moe, layer.moe_config = int4_fused, fused, config


def _dummy_groups(layer: nn.Module) -> None:
    """Random zero points and scales of about 0.003 (weights of about N(0, 0.02), as the loader's random AWQ
    linears have) for packed weights the loader drew."""
    gen = torch.Generator(device=layer.w13.device).manual_seed(0)
    for name in ("w13", "w2"):
        getattr(layer, f"{name}_qzeros").random_(0, 16, generator=gen)
        getattr(layer, f"{name}_scales").normal_(0.0, 0.003, generator=gen).abs_()


def _dequantized(experts: Int4Experts, dtype: torch.dtype) -> torch.Tensor:
    """The stack dequantised to `dtype`, one expert at a time (no float32 copy of the whole stack)."""
    out = torch.empty(experts.shape, dtype=dtype, device=experts.qweight.device)
    for e in range(out.shape[0]):
        out[e] = moe_int4_reference.dequantize(Int4Experts(*(t[e : e + 1] for t in experts)))[0]
    return out
