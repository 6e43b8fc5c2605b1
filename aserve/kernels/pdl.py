"""Programmatic dependent launch (PDL, compute capability 9.0+): a kernel launched with it may start while the kernel
before it in the stream is still finishing, so launch latency and the previous kernel's tail overlap; inside a CUDA
graph the dependency is kept as a programmatic edge. In a decode step of a small batch (hundreds of kernels of a few
microseconds each) those gaps add up.

Every kernel of aserve/kernels/ that takes USE_PDL calls `gdc_sync` (below) before it touches memory an earlier kernel
may write or read, and in every program, even one that returns early: a kernel's completion then implies its
predecessor's, so ordering stays transitive. The launches pass `**launch_kwargs()`.

Off unless `enable()` is called (the model loader does on Hopper-class GPUs; ASERVE_PDL=0 keeps it off).
"""

from __future__ import annotations

import triton
import triton.language as tl

ENABLED = False


def enable(on: bool = True) -> None:
    global ENABLED
    ENABLED = bool(on)


def launch_kwargs() -> dict:
    return {"launch_pdl": True} if ENABLED else {}


@triton.jit
def gdc_sync(USE_PDL: tl.constexpr):
    """Waits for the previous kernel (all of its programs, memory flushed), then lets the next kernel's programs be
    scheduled as soon as this one's are all running."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
