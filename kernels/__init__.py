"""Triton kernels. Each has a pure-torch reference in kernels.reference, and tests compare the two."""
