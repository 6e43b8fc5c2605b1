"""AWQ int4 at run time: the AutoAWQ checkpoint format (awq_format) and the int4 linear layer (awq_linear). The
offline quantiser that writes such checkpoints is aserve/quantize. See docs/quantization.md."""
