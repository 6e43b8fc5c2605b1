"""Deterministic mode (`--deterministic`, `LLM(deterministic=True)`): the layers whose every row is computed in one
reduction order that depends on nothing but that row, so that a request's logits are the same bits whatever else is
in the step, however its prompt is chunked and whether its prefix came from the cache.

Where normal mode's kernels vary with the batch (measured on CPU: oneDNN / MKL pick other kernels, and so other sums,
by the number of rows; one-row bf16 inputs run the C GEMV, more rows oneDNN; float32 matmuls differ between 1-3 rows
and 4+; attention runs decodes on the C kernel and prompts on SDPA; speculative verification's k+1-token queries on
SDPA too), deterministic mode chooses, once, when the model is built:

    linear layers   BatchInvariantLinearMethod: CPU, the C kernel aserve/kernels/cpu.py gemm_rows over a packed copy
                    of the weight, for every row count (the CPU one-token forward, aserve/models/cpu_one_token.py,
                    runs it too); GPU, the Triton matmul of aserve/kernels/batch_invariant_matmul.py (one tile shape
                    whatever M is, no split-K)
    element-wise    CPU: the C kernels for every row count and dtype (SiLU·mul in C for float32 too, where eager torch
                    could round a chunk's tail another way; Qwen3's q/k norms through the C RMSNorm); GPU: the Triton
                    kernels, one program per row already
    attention       aserve/layers/attention/batch_invariant.py (CPU) and triton_batch_invariant.py (GPU), chosen by
                    select_attention_backend

RMSNorm, rotary and SiLU·mul are per-row kernels in both modes. Sampling is aserve/worker/batch_invariant_sampler.py.
Families whose forward runs other batched torch ops (Gemma's soft-capping and GeGLU, mixture-of-experts blocks) and
quantised checkpoints are refused (`check_supported`), rather than served with a guarantee that does not hold.
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.kernels import cpu
from aserve.layers.elementwise import NativeCpuElementwiseOps, TritonElementwiseOps
from aserve.layers.linear import Linear, UnquantizedLinearMethod

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM")  # fmt: skip


def check_supported(architecture: str, quantization: str | None) -> None:
    """Raises a ValueError naming deterministic mode where it cannot hold its guarantee (a quantised checkpoint is
    refused when the model is built: use_batch_invariant_linears)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"deterministic mode supports {', '.join(SUPPORTED_ARCHITECTURES)}; {architecture} is not "
                         "among them (turn deterministic off)")  # fmt: skip
    if quantization is not None:
        raise ValueError(f"deterministic mode runs unquantised weights only, not --quantization {quantization} "
                         "(turn deterministic off, or serve a 16/32-bit checkpoint)")  # fmt: skip


def _cpu_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = cpu.gemm_rows(layer.packed_weight, x, layer.weight.shape[0])
    return y if layer.bias is None else y + layer.bias


def _triton_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.bi_matmul(x, layer.weight, layer.bias, layer.bi_config)


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """The unquantised weights (same parameters and loading), run by a kernel whose sums per output element depend
    on K alone. process_weights_after_loading sets `kernel` and, on CPU, `packed_weight` (what gemm_rows reads: a
    packed bf16 copy, or the float32 weight) and `rows_packed` (True: the one-token forward may run gemm_rows over
    it); on a GPU `bi_matmul` / `bi_config` (the Triton matmul and its tile shape, chosen from N and K)."""

    @staticmethod
    def _reset(layer: nn.Module) -> None:
        UnquantizedLinearMethod._reset(layer)
        layer.rows_packed = False
        layer.bi_matmul = layer.bi_config = None

    def process_weights_after_loading(self, layer):
        self._reset(layer)
        w = layer.weight
        if w.is_cuda:
            from aserve.kernels import batch_invariant_matmul  # Triton: imported where a GPU runs it

            layer.bi_matmul = batch_invariant_matmul.matmul
            layer.bi_config = batch_invariant_matmul.config_for(*w.shape)
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


def use_batch_invariant_linears(model: nn.Module) -> None:
    """Gives every linear layer of a model built on the meta device (before its weights load) the batch-invariant
    method."""
    for name, module in model.named_modules():
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
