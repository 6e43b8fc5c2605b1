"""The linear layer of every model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve import envs


class Linear(nn.Linear):
    """nn.Linear that, on CPU in bf16, runs on a weight copy prepacked once for oneDNN's blocked (AMX) layout:
    1.3-2x faster than F.linear, which reorders the weight on every call."""

    packed_weight: torch.Tensor | None = None
    cpu_gemv = False  # one-row inputs run aserve/kernels/cpu_gemv.py (set by prepack)
    # CPU, one-row inputs of prepacked bf16 linears: a GEMV on the plain weight instead of oneDNN
    # (aserve/kernels/cpu_gemv.py where it applies, else torch.mv; ASERVE_CPU_MV=0: off; set by prepack).
    mv_one_row = False
    gemv_config: dict | None = None  # GPU: one-row inputs (batch-1 decode) run aserve/kernels/gemv.py
    gemv_silu_config: dict | None = None  # ... and with SiLU·mul fused in (forward_silu_mul); None: gemv_config

    def use_gemv(self, config: dict | None = None) -> bool:
        """GPU, 16-bit weights: route one-row inputs to the Triton GEMV (aserve/kernels/gemv.py), which streams the
        weight faster than cuBLAS at M = 1. False when it does not apply (then F.linear as before)."""
        from aserve.kernels.gemv import gemv_config

        if not (self.weight.is_cuda and self.weight.dtype in (torch.bfloat16, torch.float16)):
            return False
        self.gemv_config = gemv_config(*self.weight.shape, config)
        self.gemv_silu_config = gemv_config(*self.weight.shape, config, silu_mul=True)
        return self.gemv_config is not None

    def prepack(self) -> bool:
        if not (self.weight.is_cpu and self.weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()):
            return False
        try:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        except (RuntimeError, AttributeError):  # a torch build without it: plain F.linear
            return False
        from aserve.kernels import cpu_gemv

        self.cpu_gemv = cpu_gemv.supports(self.weight)
        self.mv_one_row = envs.ASERVE_CPU_MV
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            if x.shape[0] == 1 and self.mv_one_row:  # batch-1 decode: a GEMV streams the weight faster
                if self.cpu_gemv:
                    from aserve.kernels.cpu_gemv import gemv

                    y = gemv(self.weight, x[0]).unsqueeze(0)
                else:
                    y = torch.mv(self.weight, x[0]).unsqueeze(0)
                return y if self.bias is None else y + self.bias
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        if self.takes_gemv(x):
            from aserve.kernels.gemv import gemv

            return gemv(x, self.weight, self.bias, config=self.gemv_config)
        return F.linear(x, self.weight, self.bias)

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Does this input (one row, GPU) run the Triton GEMV? Then forward_silu_mul fuses SiLU·mul into it too."""
        return self.gemv_config is not None and x.dim() == 2 and x.shape[0] == 1

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, then this linear, in the GEMV's prologue (takes_gemv must hold)."""
        from aserve.kernels.gemv import gemv

        return gemv(gate_up, self.weight, self.bias, config=self.gemv_silu_config or self.gemv_config, silu_mul=True)

    def load_output_slice(self, param: nn.Parameter, start: int, size: int, tensor: torch.Tensor) -> None:
        """Copies one part of a fused layer (output features [start, start + size)) into `param`."""
        param.data[start : start + size].copy_(tensor)
