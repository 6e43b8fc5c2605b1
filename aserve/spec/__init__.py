"""Speculative decoding: proposers (n-gram, layer-skip, draft model), the adaptive policy, its configuration.
Verification is part of the sampler (aserve/engine/sampler.py)."""
