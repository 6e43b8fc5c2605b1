"""Triton kernels. Each has a pure-torch reference in aserve.kernels.reference, and tests compare the two."""
