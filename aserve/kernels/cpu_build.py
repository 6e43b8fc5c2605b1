"""Builds aserve's CPU kernels (C++ in aserve/kernels/csrc) into one torch extension with torch.utils.cpp_extension,
once per machine, and loads it. `load_all()` compiles and loads everything at once; the engine calls it at start, so
that no request waits for a compile. The kernels' Python API, and what each kernel does, is aserve/kernels/cpu.py.

    csrc/cpu_common.h, cpu_kernels.h    bf16 <-> float32, AVX-512 sums and exp2; the kernels' C entry points
    csrc/attention_common.h             what the two decode attention kernels share (exp2, sliding window, softcap,
                                        the portable per-head loops over rows widened to float32)
    csrc/elementwise.cpp, gemv.cpp,     the kernels, raw pointers in (aserve/kernels/cpu.py describes them)
        gemm_rows.cpp, gemm_int8.cpp,
        attention.cpp, attention_fp8.cpp,
        sample.cpp
    csrc/ops.cpp                        typed ops, torch.ops.aserve.*: tensors in and out, arguments checked; the
                                        Python functions of aserve/kernels/cpu.py call these
    csrc/raw.cpp                        the extension's module: the C entry points with integer pointers, for the
                                        one-token forward (aserve/models/cpu_one_token.py, ~270 calls per token), where
                                        a typed op would cost ~2 us more per call (bench/cpu_call_overhead.py)

Flags: -O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math. -march=native makes a build specific to the
CPU's instruction sets, so they are part of the cache key: the build lives in
$ASERVE_CACHE/torch_extensions/aserve_cpu_<key> (default ~/.cache/aserve), key = hash of the compiler's predefined
macros under -march=native (its version and every instruction set it targets on this CPU: __AVX512BF16__,
__AMX_TILE__, ...; kept in target_macros.txt beside the library), the sources, the flags and the torch and Python
versions. A cache shared by several machines holds one build per kind of CPU; a build made for AVX-512 or AMX is
never loaded on a CPU without them. A build runs in a directory of its own and its library is then renamed into
place: concurrent starts each build and one wins, and a killed build leaves neither a lock nor half a library.

-fopenmp links libgomp.so.1, which the dynamic loader resolves to the libgomp torch has already loaded: the kernels'
OpenMP regions run on torch's threads. ASERVE_CPU_KERNELS=0 turns the kernels off; without a working compiler (CXX,
default c++, as torch.utils.cpp_extension picks it) or ninja, load_all() warns and returns None, and callers keep
their torch paths.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

import torch

from aserve import envs

logger = logging.getLogger("aserve")

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = ("elementwise.cpp", "gemv.cpp", "gemm_rows.cpp", "gemm_int8.cpp", "attention.cpp", "attention_fp8.cpp",
           "sample.cpp", "ops.cpp", "raw.cpp")  # fmt: skip
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)

_loaded: dict[str, types.ModuleType | None] = {}  # "module": the outcome of this process's load_all()


def cache_dir() -> str:
    root = envs.ASERVE_CACHE
    return os.path.join(root, "torch_extensions")


def target_macros(cxx: str) -> str:
    """The compiler's predefined macros under -march=native: its version and the instruction sets a build targets on
    this CPU (what the sources' #if's test)."""
    return subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull], check=True,
                          capture_output=True, text=True, timeout=60).stdout  # fmt: skip


def build(csrc: str = CSRC) -> types.ModuleType:
    """The extension of `csrc`'s sources for this CPU: loaded from the cache, or compiled into it first. Raises where
    it cannot be built. Registers nothing (load_all registers the typed ops)."""
    cxx = envs.CXX
    macros = target_macros(cxx)
    key = hashlib.sha256()
    for part in (macros, " ".join(CFLAGS + LDFLAGS), torch.__version__, sys.version):
        key.update(part.encode() + b"\0")
    for name in sorted(f for f in os.listdir(csrc) if f.endswith((".h", ".cpp"))):
        with open(os.path.join(csrc, name), "rb") as f:
            key.update(name.encode() + b"\0" + f.read())
    name = f"aserve_cpu_{key.hexdigest()[:16]}"
    final_dir = os.path.join(cache_dir(), name)
    library = os.path.join(final_dir, f"{name}.so")
    if os.path.exists(library):
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return _compile(name, csrc, macros, final_dir)


def _compile(name: str, csrc: str, macros: str, final_dir: str) -> types.ModuleType:
    # Imported here: only a cold build needs it (it imports setuptools, ~0.2 s).
    from torch.utils import cpp_extension

    os.makedirs(cache_dir(), exist_ok=True)
    build_dir = tempfile.mkdtemp(prefix=f"{name}.build-", dir=cache_dir())
    try:
        logger.info("compiling the CPU kernels for this CPU (once per machine), into %s", final_dir)
        t0 = time.perf_counter()
        module = cpp_extension.load(
            name,
            [os.path.join(csrc, s) for s in SOURCES],
            extra_cflags=list(CFLAGS),  # copies: load() appends to its lists
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[csrc],
            build_directory=build_dir,
        )
        os.makedirs(final_dir, exist_ok=True)
        with open(os.path.join(final_dir, "target_macros.txt"), "w") as f:
            f.write(macros)
        os.replace(os.path.join(build_dir, f"{name}.so"), os.path.join(final_dir, f"{name}.so"))  # atomic
        logger.info("compiled the CPU kernels in %.1f s", time.perf_counter() - t0)
        return module
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def load_all() -> types.ModuleType | None:
    """Compiles (the first time on this machine) and loads all CPU kernels, once per process, and registers the typed
    ops torch.ops.aserve.*. -> the extension's module (the raw entry points of csrc/raw.cpp), or None: turned off
    (ASERVE_CPU_KERNELS=0) or not buildable here (a warning says why; callers keep their torch paths)."""
    if "module" not in _loaded:
        _loaded["module"] = None
        if envs.ASERVE_CPU_KERNELS:
            try:
                module = build()
                module.register_ops()
                _loaded["module"] = module
            except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:
                text = f"{e} {getattr(e, 'stderr', '') or ''}".strip()
                text = text if len(text) <= 1500 else f"{text[:300]} ... {text[-1200:]}"
                logger.warning("CPU kernels unavailable, using the torch paths (a working C++ compiler, CXX, and ninja "
                               "build them; ASERVE_CPU_KERNELS=0 skips them): %s", text)  # fmt: skip
    return _loaded["module"]
