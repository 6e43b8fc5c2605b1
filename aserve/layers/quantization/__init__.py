"""Quantisation at run time: the checkpoint formats and the linear layers' methods. The offline quantiser that
writes such checkpoints is aserve/quantize. See docs/quantization.md."""
