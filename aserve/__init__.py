"""aserve: an LLM inference server with paged KV cache, prefix sharing and continuous batching."""

from aserve.config import EngineArgs
from aserve.engine.async_engine import AsyncEngine
from aserve.engine.llm_engine import LLMEngine
from aserve.entrypoints.llm import LLM
from aserve.inputs import PromptType, TextPrompt, TokensPrompt
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.sampling_params import SamplingParams, StructuredOutputsParams
from aserve.version import __version__

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EngineArgs",
    "LLM",
    "LLMEngine",
    "Logprob",
    "PromptType",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
