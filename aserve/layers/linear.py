"""The linear layer of every model: y = x W^T + b, where how W is stored, loaded and multiplied belongs to the
layer's quantisation method (aserve/layers/quantization/base.py), chosen once at construction."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.unquantized import UnquantizedLinearMethod


class Linear(nn.Module):
    """`quant_config` None: unquantised; else its method for the checkpoint linears `checkpoint_names` this layer
    holds (one, or a fused layer's parts, e.g. model.layers.0.mlp.{gate,up}_proj). Models are built on the meta
    device; the loader fills the parameters, then calls process_weights_after_loading once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        checkpoint_names: Sequence[str] = (),
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if quant_config is None:
            self.quant_method = UnquantizedLinearMethod()
        else:
            self.quant_method = quant_config.get_linear_method(checkpoint_names)
        dtype = params_dtype or torch.get_default_dtype()
        self.quant_method.create_weights(self, in_features, out_features, bias, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"quant_method={type(self.quant_method).__name__}")  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def load_output_slice(self, param: nn.Parameter, start: int, size: int, tensor: torch.Tensor) -> None:
        """Copies one part of a fused layer (output features [start, start + size)) into `param`."""
        self.quant_method.load_output_slice(self, param, start, size, tensor)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    # A Llama MLP's SiLU·mul inside this layer's kernel (see aserve/layers/quantization/base.py).

    def fuses_silu_mul_out(self, x: torch.Tensor) -> bool:
        return self.quant_method.fuses_silu_mul_out(self, x)

    def forward_silu_mul_out(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply_silu_mul_out(self, x)

    def fuses_silu_mul_in(self, gate_up: torch.Tensor) -> bool:
        return self.quant_method.fuses_silu_mul_in(self, gate_up)

    def forward_silu_mul_in(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply_silu_mul_in(self, gate_up)
