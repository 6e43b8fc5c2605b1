"""Deterministic mode (`--deterministic`, `LLM(deterministic=True)`): the layers whose every row is computed in one
reduction order that depends on nothing but that row, so that a request's logits are the same bits whatever else is
in the step, however its prompt is chunked and whether its prefix came from the cache.

Where normal mode's kernels vary with the batch (measured on CPU: oneDNN / MKL pick other kernels, and so other sums,
by the number of rows; one-row bf16 inputs run the C GEMV, more rows oneDNN; float32 matmuls differ between 1-3 rows
and 4+; attention runs decodes on the C kernel and prompts on SDPA; speculative verification's k+1-token queries on
SDPA too), deterministic mode chooses, once, when the model is built:

    linear layers   BatchInvariantLinearMethod: CPU, the C kernel aserve/kernels/cpu.py gemm_rows over a packed copy
                    of the weight, for every row count (the CPU one-token forward, aserve/models/cpu_one_token.py,
                    runs it too); GPU, the Triton matmul of aserve/kernels/batch_invariant_matmul.py (one K
                    order from the weight's shape, whatever M is; its tiles by M checked on the device at load),
                    or for weights of at most ROWS_GEMV_MAX_N outputs (a mixture of experts' router) the row-wise
                    GEMV of aserve/kernels/gemv.py (gemv_rows: each row summed as a one-row input is, at every M),
                    whose one-row launch streams such a narrow weight with more programs than the matmul's tiles
    element-wise    CPU: the C kernels for every row count and dtype (SiLU·mul in C for float32 too, where eager torch
                    could round a chunk's tail another way; Qwen3's q/k norms through the C RMSNorm); GPU: the Triton
                    kernels, one program per row already
    attention       aserve/layers/attention/batch_invariant.py (CPU) and triton_batch_invariant.py (GPU), chosen by
                    select_attention_backend
    experts         BatchInvariantMoEMethod (mixture-of-experts blocks, aserve/layers/moe.py): the router is a
                    linear layer above; routing is per row (float32 softmax over the experts, top-k,
                    renormalisation over the k). CPU: each expert's two projections run gemm_rows over packed
                    copies of its weights and SiLU·mul the C kernel, on whichever of the step's tokens chose it;
                    every token's k weighted outputs are added in expert order. GPU: the fused Triton kernels with
                    tiles that all sum K in the same steps (a row's sums do not depend on the rows that share its
                    tile), chosen by the step's slots where a check at load shows the same bits through each, else
                    one configuration for every number of tokens, and each token's k outputs added in slot order
    Gemma 2 / 3     models/gemma2.py's use_batch_invariant. CPU: the (1 + w) RMSNorms (also Gemma 3's q / k
                    norms) through the C RMSNorm in float32 (gemma_rms_norm below); GeGLU and the final logits'
                    soft-cap with tanh_rows, a tanh of +, * and / alone (torch's GELU-tanh rounds some elements
                    differently on its vectorised and scalar paths, which an element takes by where it falls in a
                    thread's share of the tensor, so by the number of rows): within a few float32 ulps of torch's
                    tanh, so a Gemma's numbers differ from normal mode's by roundings; attention scores' soft-cap
                    and sliding windows are the C attention kernel's. GPU: normal mode's Triton kernels for the
                    norms and GeGLU (aserve/kernels/gemma.py: one program per row or element), tanh_rows for the
                    soft-cap

RMSNorm, rotary and SiLU·mul are per-row kernels in both modes. Sampling is aserve/worker/batch_invariant_sampler.py.
Refused (`check_supported`, and when the model is built), rather than served with a guarantee that does not hold:
other families, quantised checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.kernels import cpu, reference
from aserve.layers.elementwise import NativeCpuElementwiseOps, TritonElementwiseOps
from aserve.layers.linear import Linear, UnquantizedLinearMethod
from aserve.layers.moe import FusedMoE

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                           "Qwen3MoeForCausalLM")  # fmt: skip


def check_supported(architecture: str, quantization: str | None) -> None:
    """Raises a ValueError naming deterministic mode where it cannot hold its guarantee (a quantised checkpoint is
    refused when the model is built: use_batch_invariant_linears)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"deterministic mode supports {', '.join(SUPPORTED_ARCHITECTURES)}; {architecture} is not "
                         "among them (turn deterministic off)")  # fmt: skip
    if quantization is not None:
        raise ValueError(f"deterministic mode runs unquantised weights only, not --quantization {quantization} "
                         "(turn deterministic off, or serve a 16/32-bit checkpoint)")  # fmt: skip


# tanh(x) ~ x P(x^2) / Q(x^2) on [-TANH_CLAMP, TANH_CLAMP] (Eigen's float tanh, a few ulps), x itself near 0
TANH_CLAMP = 7.90531110763549805
TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
          1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)  # fmt: skip
TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)


def _horner(x2: torch.Tensor, coefficients: tuple) -> torch.Tensor:
    acc = torch.full_like(x2, coefficients[0])
    for c in coefficients[1:]:
        acc = acc * x2 + c
    return acc


def tanh_rows(x: torch.Tensor) -> torch.Tensor:
    """float32 tanh from +, * and / alone, each rounded as IEEE says on every path (torch's tanh and GELU-tanh have
    a vectorised and a scalar path, taken by where an element falls in a thread's share of the tensor)."""
    x = x.clamp(-TANH_CLAMP, TANH_CLAMP)
    x2 = x * x
    return torch.where(x.abs() < 0.0004, x, x * _horner(x2, TANH_P) / _horner(x2, TANH_Q))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU, gelu_tanh(gate) * up, with tanh_rows; gelu in float32, rounded to the model's dtype, then *
    up (as torch's F.gelu(approximate="tanh") and the product round it)."""
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.float()
    inner = (g + g * g * g * 0.044715) * 0.7978845608028654  # sqrt(2 / pi)
    return ((g * 0.5) * (tanh_rows(inner) + 1.0)).to(gate.dtype) * up


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's final logits) with tanh_rows, each step rounded to x's dtype."""
    return tanh_rows((x / cap).float()).to(x.dtype) * cap


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (x / rms(x) * (1 + w) in float32, rounded to x's dtype once) by the C RMSNorm in float32
    over rows of the last dimension (torch's mean could sum a row in another order by the number of rows)."""
    n = x.shape[-1]
    y = cpu.add_rms_norm(x.float().reshape(-1, n), None, 1.0 + weight.float(), eps)[0]
    return y.view(x.shape).to(x.dtype)


def _cpu_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = cpu.gemm_rows(layer.packed_weight, x, layer.weight.shape[0])
    return y if layer.bias is None else y + layer.bias


def _triton_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.bi_matmul(x, layer.weight, layer.bias, layer.bi_config)


# Narrow weights on GPUs: the row-wise GEMV (a launch configuration for all row counts; its rows' bits do not depend
# on M or on the rows that share a program, checked bit for bit against the one-row GEMV on an H100 at 1-2048 rows).
ROWS_GEMV_MAX_N = 256
ROWS_GEMV_CONFIG = dict(BLOCK_N=2, BLOCK_K=512, num_warps=2, num_stages=3)


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """The unquantised weights (same parameters and loading), run by a kernel whose sums per output element depend
    on K alone. process_weights_after_loading sets `kernel` and, on CPU, `packed_weight` (what gemm_rows reads: a
    packed bf16 copy, or the float32 weight) and `rows_packed` (True: the one-token forward may run gemm_rows over
    it); on a GPU `bi_matmul` / `bi_config` (the Triton matmul and its tiling and split-K, chosen from N, K and
    the dtype, and checked on the device: checked_config; narrow weights: gemv_rows and ROWS_GEMV_CONFIG)."""

    @staticmethod
    def _reset(layer: nn.Module) -> None:
        UnquantizedLinearMethod._reset(layer)
        layer.bi_matmul = layer.bi_config = None

    def process_weights_after_loading(self, layer):
        self._reset(layer)
        w = layer.weight
        if w.is_cuda:
            from aserve.kernels import batch_invariant_matmul, gemv  # Triton: imported where a GPU runs it

            n, k = w.shape
            if n <= ROWS_GEMV_MAX_N and (config := gemv.gemv_config(n, k, ROWS_GEMV_CONFIG)) is not None:
                layer.bi_matmul, layer.bi_config, layer.kernel = gemv.gemv_rows, config, _triton_rows
                return
            layer.bi_matmul = batch_invariant_matmul.matmul
            layer.bi_config = batch_invariant_matmul.checked_config(w.detach())
            layer.kernel = _triton_rows
            return
        if not cpu.gemm_rows_supports(w):
            raise ValueError(
                f"deterministic mode on CPU needs aserve's C kernels (a C++ compiler and ninja; ASERVE_CPU_KERNELS "
                f"not 0) and float32 / bfloat16 weights; this layer's are {w.dtype} on {w.device}"
            )
        layer.packed_weight = cpu.gemm_rows_prepare(w.detach())
        layer.kernel = _cpu_rows
        layer.rows_packed = w.dtype == torch.bfloat16


def _cpu_experts(layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """aserve/layers/moe.py per_expert_matmuls with gemm_rows and the C SiLU·mul: a token's result depends on its
    own row and routing alone, not on which or how many other tokens chose the same experts."""
    weights, ids = reference.select_experts(router_logits, layer.top_k, layer.renormalize)
    slots = ids.flatten()
    order = slots.argsort(stable=True)
    counts = torch.bincount(slots, minlength=layer.num_experts).tolist()
    out = torch.zeros_like(x)
    hidden, inter2 = x.shape[1], 2 * layer.intermediate_size
    for expert, expert_slots in enumerate(order.split(counts)):
        if not counts[expert]:
            continue
        tokens = expert_slots // layer.top_k
        h = cpu.silu_mul(cpu.gemm_rows(layer.packed_w13[expert], x[tokens], inter2))
        h = cpu.gemm_rows(layer.packed_w2[expert], h, hidden)
        out.index_add_(0, tokens, (h * weights.view(-1)[expert_slots, None]).to(out.dtype))
    return out


class BatchInvariantMoEMethod:
    """Deterministic mode's kernel for a FusedMoE block (its `kernel_method`). CPU: _cpu_experts over per-expert
    gemm_rows_prepare copies of w13 / w2 (`packed_w13`, `packed_w2`). GPU: the fused Triton kernels with their
    deterministic configurations (moe.moe_config: tiles by the step's slots, one K step), or SMALL_CONFIG for every
    number of tokens where moe.deterministic_tiles_agree does not hold on the device, and each token's k outputs
    added in a fixed order: a row's routing, its two GEMMs' sums and its total depend on nothing but the row, and
    nothing reads the routing back to the host (CUDA graphs capture it)."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if layer.w13.is_cuda:
            from aserve.kernels import moe  # Triton: imported where a GPU runs it

            # Tiles by the step's slots where the device gives a token the same bits through each, else one
            tiles = moe.deterministic_tiles_agree(layer.w13, layer.w2, layer.top_k, layer.renormalize)
            layer.use_triton(None if tiles else moe.SMALL_CONFIG, fixed_order_sum=True)
            return
        if not cpu.gemm_rows_supports(layer.w13[0]):
            raise ValueError(f"deterministic mode on CPU needs aserve's C kernels (a C++ compiler and ninja; "
                             f"ASERVE_CPU_KERNELS not 0) and float32 / bfloat16 experts, here "
                             f"{layer.w13.dtype}")  # fmt: skip
        layer.packed_w13 = [cpu.gemm_rows_prepare(w.detach()) for w in layer.w13]
        layer.packed_w2 = [cpu.gemm_rows_prepare(w.detach()) for w in layer.w2]
        layer.kernel = _cpu_experts


def use_batch_invariant_linears(model: nn.Module) -> None:
    """Gives every linear layer of a model built on the meta device (before its weights load) the batch-invariant
    method, every mixture-of-experts block BatchInvariantMoEMethod, and lets every module with a
    `use_batch_invariant()` swap in the functions above."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            module.kernel_method = BatchInvariantMoEMethod()
        if hasattr(module, "use_batch_invariant"):  # a family's own torch ops (models/gemma2.py)
            module.use_batch_invariant()
        if isinstance(module, Linear):
            if type(module.quant_method) is not UnquantizedLinearMethod:
                raise ValueError(f"deterministic mode runs unquantised linears only; {name} is "
                                 f"{type(module.quant_method).__name__}")  # fmt: skip
            module.quant_method = BatchInvariantLinearMethod()
            module.quant_method._reset(module)


class BatchInvariantCpuElementwiseOps(NativeCpuElementwiseOps):
    """The C kernels for everything, both dtypes: per-row loops whose order depends on the row's length alone."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self._silu_and_mul = cpu.silu_mul

    def qk_norm(self, qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
        t = qkv.shape[0]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = cpu.add_rms_norm(q.reshape(t * num_heads, head_dim), None, q_weight, eps)[0]
        k = cpu.add_rms_norm(k.reshape(t * num_kv_heads, head_dim), None, k_weight, eps)[0]
        return torch.cat([q.view(t, -1), k.view(t, -1), v], dim=-1)


def select_batch_invariant_ops(device: torch.device, dtype: torch.dtype):
    """The element-wise ops of deterministic mode: Triton on a GPU, the C kernels on CPU (required there)."""
    if device.type == "cuda":
        return TritonElementwiseOps()
    if not cpu.elementwise_supports(dtype):
        raise ValueError(f"deterministic mode on CPU needs aserve's C kernels (a C++ compiler and ninja; "
                         f"ASERVE_CPU_KERNELS not 0) and a float32 / bfloat16 model, here {dtype}")  # fmt: skip
    return BatchInvariantCpuElementwiseOps(dtype)
