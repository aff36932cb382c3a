"""pagedserve's inference engine: vLLM's API over a paged KV cache with continuous batching.

from engine import LLM, SamplingParams
outputs = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from engine.config import EngineArgs, EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
