"""CPU: keep freed memory in the process instead of handing it back to the OS after every step.

glibc serves large allocations (a prefill chunk's activations: [2048, 3072] bf16 is 12 MB) with fresh mmaps and
gives them back on free, so every step faults every page of its activations in again and the kernel zeroes them:
on the 2-core development VM, a 64 x 256-token prefill took ~550,000 page faults and 1-1.7 s of system time out of
~5 s (docs/benchmarks.md). With mmap off for allocations and a high trim threshold, freed blocks stay in malloc's
heap and the next step reuses them. (vLLM's CPU backend reaches the same with tcmalloc preloaded.)
ASERVE_CPU_MALLOC=0 leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from aserve import envs

logger = logging.getLogger("aserve")

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied = False


def retain_freed_memory() -> bool:
    """Tells glibc's malloc to keep freed memory (no mmap per large allocation, trim only above 1 GiB of free heap).
    Once per process; False where it does not apply (not glibc, or ASERVE_CPU_MALLOC=0)."""
    global _applied
    if _applied:
        return True
    if not envs.ASERVE_CPU_MALLOC:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    if not ok:
        logger.info("mallopt did not take the CPU memory settings; glibc defaults stay")
    _applied = ok
    return ok
