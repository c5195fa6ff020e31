"""nextn: exact, fast MTP speculative decoding for Qwen3.5 / Qwen3-Next hybrid models."""

from nextn.core import RequestOutput, SamplingParams, SpecStats
from nextn.engine.llm import LLM, RequestError

__all__ = ["LLM", "RequestError", "RequestOutput", "SamplingParams", "SpecStats"]
