"""A mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE): a router and E SiLU-gated experts, each token
through its top_k experts, their outputs summed with the routing weights.

Routing as transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: softmax over all E router logits in float32,
the top_k probabilities, renormalised to sum to 1 where the family asks (Mixtral always; Qwen3-MoE with
norm_topk_prob). (Qwen3-MoE without renormalisation rounds the weights to the model's dtype before using them; here
they stay float32: the same in float32, within a rounding in 16-bit.)

The experts' weights are stacked, one tensor per projection:

    w13 [E, 2 I, H]   expert e's gate_proj rows [0, I), then its up_proj rows [I, 2 I)
    w2  [E, H, I]     expert e's down_proj

The kernel is chosen once, in process_weights_after_loading, by the weights' device:

    CUDA        aserve/kernels/moe.py fused_moe: routing and grouping by expert in three Triton kernels, one grouped
                GEMM per projection (SiLU·mul in the first one's epilogue, the routing weight in the second's); a
                few tokens (T * k <= E / 4) two kernels of aserve/kernels/moe_decode.py instead; large bf16 experts
                (Mixtral's) on compute capability 9 / 10 past a few tokens through torch._grouped_mm
                (aserve/kernels/moe_grouped_mm.py: CUTLASS's grouped GEMM); int4 experts kept
                packed (aserve/layers/quantization/int4_moe.py): the same two paths over packed weights,
                aserve/kernels/moe_int4.py (the quantisation method's use_triton picks them)
    otherwise   per-expert matmuls: the tokens routed to each expert gathered, through its two projections, added
                back weighted (in expert order, as transformers adds them); one token with bf16 experts on a CPU
                with the C GEMV (aserve/kernels/cpu.py): its experts' projections as GEMVs; 16-bit experts on a
                CPU without a native 16-bit GEMM: the linear layers' widened float32 GEMMs (linear.py widens)

unless the block was given a `kernel_method` when the model was built (deterministic mode: aserve/layers/
batch_invariant.py), whose process_weights_after_loading(layer) picks the kernel instead.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels import cpu, reference
from aserve.layers.elementwise import silu_and_mul
from aserve.layers.linear import Linear, widened_linear, widens

if TYPE_CHECKING:  # (the quantisation configs import this module's UnquantizedMoEMethod)
    from aserve.layers.quantization.base import QuantizationConfig


def per_expert_matmuls(layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The CPU kernel: for each expert with tokens, its two projections over those tokens' rows through
    `expert_linear` (an expert with one row, where `expert_gemv`: the C GEMV, as the linear layers run one row)."""
    weights, ids = reference.select_experts(router_logits, layer.top_k, layer.renormalize)
    out = torch.zeros_like(x)
    if layer.expert_gemv and x.shape[0] == 1:  # decode: no grouping needed
        for j in ids[0].argsort().tolist():
            out[0] += (_expert_gemv(layer, int(ids[0, j]), x[0]) * weights[0, j]).to(out.dtype)
        return out
    slots = ids.flatten()
    order = slots.argsort(stable=True)
    counts = torch.bincount(slots, minlength=layer.num_experts).tolist()
    for expert, expert_slots in enumerate(order.split(counts)):
        if not counts[expert]:
            continue
        tokens = expert_slots // layer.top_k
        if layer.expert_gemv and counts[expert] == 1:
            h = _expert_gemv(layer, expert, x[tokens[0]])[None]
        else:
            linear = layer.expert_linear
            h = linear(silu_and_mul(linear(x[tokens], layer.w13[expert])), layer.w2[expert])
        out.index_add_(0, tokens, (h * weights.view(-1)[expert_slots, None]).to(out.dtype))
    return out


def _expert_gemv(layer: FusedMoE, expert: int, row: torch.Tensor) -> torch.Tensor:
    """One row [H] through the expert's two projections as C GEMVs -> [H]."""
    return cpu.gemv(layer.w2[expert], silu_and_mul(cpu.gemv(layer.w13[expert], row)[None])[0])


def triton_fused(layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The GPU kernel (aserve/kernels/moe.py, set on the layer by use_triton); FP8 experts with their row scales."""
    return layer.triton_moe(x, router_logits, layer.w13, layer.w2, layer.top_k, layer.renormalize, layer.moe_config,
                            layer.w13_scale, layer.w2_scale)  # fmt: skip


class UnquantizedMoEMethod:
    """16-bit (or float32) experts: used as loaded."""

    def create_weights(self, layer: FusedMoE, hidden_size: int) -> None:
        e, i = layer.num_experts, layer.intermediate_size
        layer.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        layer.w2 = nn.Parameter(torch.empty(e, hidden_size, i))

    def load_scale(self, layer: FusedMoE, param_name: str, expert: int, shard: int | None, tensor) -> None:
        raise ValueError(f"the checkpoint has a {param_name} scale for expert {expert}, whose weights its "
                         "quantization_config leaves unquantised")  # fmt: skip

    def load_packed(self, layer: FusedMoE, param_name: str, expert: int, shard: int | None, part: str,
                    tensor) -> bool:  # fmt: skip
        raise ValueError(f"the checkpoint has int4 tensors ({part}) for expert {expert}, whose weights its "
                         "quantization_config leaves unquantised")  # fmt: skip

    def missing_tensors(self, layer: FusedMoE) -> list[str]:
        """Checkpoint tensors of experts that loading did not see, by name, where the method tracks them."""
        return []

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def use_triton(self, layer: FusedMoE, config: dict | None = None, fixed_order_sum: bool = False) -> None:
        """The fused Triton kernels of aserve/kernels/moe.py on the layer (FusedMoE.use_triton)."""
        # Triton: optional (CPU installs may lack it), imported once it is chosen
        from aserve.kernels import moe, moe_grouped_mm

        if fixed_order_sum:
            fused = functools.partial(moe.fused_moe, fixed_order_sum=True)
        elif config is None and moe_grouped_mm.chosen_for(layer.w13):
            fused = moe_grouped_mm.fused_moe
        else:
            fused = moe.fused_moe
        layer.kernel, layer.triton_moe, layer.moe_config = triton_fused, fused, config


class FusedMoE(nn.Module):
    """The router `gate` (a linear layer, E outputs, unquantised) and the stacked experts w13, w2 (module docstring).
    `quant_config`: the checkpoint's quantisation, whose experts' method (get_moe_method, given `expert_names`: the
    checkpoint's module names of one expert's gate, up and down projections) makes w13 / w2 and prepares them after
    loading: FP8 experts (aserve/layers/quantization/fp8_moe.py) also hold w13_scale / w2_scale, AWQ / GPTQ int4
    experts (int4_moe.py) hold w13 / w2 packed (int32, with w13_qzeros / w13_scales and w2_qzeros / w2_scales)
    and keep them on a GPU, dequantised to 16-bit stacks on a CPU; quantisations without a method for experts are
    refused."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 quant_config: QuantizationConfig | None = None,
                 expert_names: tuple[str, ...] = ()) -> None:  # fmt: skip
        super().__init__()
        self.quant_method = (UnquantizedMoEMethod() if quant_config is None
                             else quant_config.get_moe_method(expert_names))  # fmt: skip
        if self.quant_method is None:
            raise ValueError(
                f"{quant_config.name} quantisation of mixture-of-experts layers is not supported; "
                "serve the 16-bit checkpoint (without --quantization, or with --quantization fp8)"
            )
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} > the number of experts {num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.w13_scale = self.w2_scale = None  # FP8 experts: float32 row scales [E, 2 I], [E, H]
        self.quant_method.create_weights(self, hidden_size)
        self.kernel = per_expert_matmuls
        self.expert_gemv = False  # one-token steps on CPU through the C GEMV (bf16 experts, AVX512-BF16)
        self.expert_linear = F.linear  # per_expert_matmuls' projections (16-bit experts widened where linear.widens)
        self.triton_moe = self.moe_config = None
        self.kernel_method = None  # set on the meta-device model to pick the kernel in its place (module docstring)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"kernel={self.kernel.__name__}")  # fmt: skip

    def load_expert(self, param: nn.Parameter, expert: int, shard: int | None, tensor: torch.Tensor) -> None:
        """One expert's checkpoint tensor into w13 (shard 0: gate_proj, 1: up_proj) or w2 (shard None)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_experts} experts")
        target = param.data[expert]
        if shard is not None:
            target = target[shard * self.intermediate_size : (shard + 1) * self.intermediate_size]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        target.copy_(tensor)

    def load_expert_scale(self, param_name: str, expert: int, shard: int | None, tensor: torch.Tensor) -> None:
        """One expert's checkpoint weight scale for w13 (shard 0 / 1) or w2, as its quantisation method stores it."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_experts} experts")
        self.quant_method.load_scale(self, param_name, expert, shard, tensor)

    def load_expert_packed(self, param_name: str, expert: int, shard: int | None, part: str,
                           tensor: torch.Tensor) -> bool:  # fmt: skip
        """One of an expert's int4 tensors (AWQ / GPTQ: qweight, qzeros, scales, g_idx) for w13 (shard 0 / 1) or
        w2, as its quantisation method takes them. -> whether that projection is now complete."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_experts} experts")
        return self.quant_method.load_packed(self, param_name, expert, shard, part, tensor)

    def process_weights_after_loading(self) -> None:
        """The experts' quantisation method prepares w13 / w2, then the kernel is picked for the weights' device
        (module docstring); the router's linear prepares its own."""
        self.kernel, self.triton_moe, self.moe_config = per_expert_matmuls, None, None
        self.quant_method.process_weights_after_loading(self)
        self.expert_gemv = cpu.gemv_supports(self.w13[0]) and cpu.gemv_supports(self.w2[0])
        self.expert_linear = widened_linear if self.w13.is_cpu and widens(self.w13.dtype) else F.linear
        if self.kernel_method is not None:
            self.kernel_method.process_weights_after_loading(self)
        elif self.w13.is_cuda:
            self.use_triton()

    def use_triton(self, config: dict | None = None, fixed_order_sum: bool = False) -> None:
        """The fused Triton kernels (on a CPU: Triton's interpreter, for tests); `config`: their launch
        configuration instead of the one chosen per call; fixed_order_sum: as fused_moe's (deterministic mode).
        The experts' quantisation method sets them (packed int4 experts: their own kernels)."""
        self.quant_method.use_triton(self, config, fixed_order_sum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(self, x, self.gate(x))
