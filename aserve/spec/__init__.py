"""Speculative decoding: proposers (n-gram, layer-skip, draft model), the adaptive policy, its configuration.
Verification is part of the sampler (aserve/worker/sampler.py), model drafting of the runner
(aserve/worker/drafter.py)."""
