"""Attention over a flat batch with a paged KV cache: the step's metadata, the backend interface and the backends."""
