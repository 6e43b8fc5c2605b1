"""The offline quantiser (`aserve quantize`): calibration, AWQ scale search, GPTQ, end-to-end tuning and perplexity
evaluation. It writes AutoAWQ-format checkpoints that the runtime layers (aserve/layers/quantization) load; it sits
on top of the engine and may import it. See docs/quantization.md."""
