"""AWQ int4: the AutoAWQ checkpoint format (awq_format), the int4 linear layer (awq_linear), the quantiser
(quantize, awq_search, dense_layer) and perplexity evaluation (perplexity). See docs/quantization.md."""
