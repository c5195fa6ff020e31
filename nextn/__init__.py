"""nextn: exact, fast MTP speculative decoding for Qwen3.5 / Qwen3-Next hybrid models."""

from nextn.core import CompletionOutput, Logprob, RequestOutput, SamplingParams, SpecStats, StructuredOutputsParams
from nextn.engine.llm import LLM, RequestError

__version__ = "0.1.0"  # the package's version: pyproject.toml reads it from here

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SpecStats",
    "StructuredOutputsParams",
    "__version__",
]
