"""Kernels: Triton (GPU; each has a pure-torch reference in aserve.kernels.reference, and tests compare the two) and
C (CPU: the Python API is aserve.kernels.cpu, built by aserve.kernels.cpu_build)."""
