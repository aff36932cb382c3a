"""pagedserve's inference engine: vLLM's API over a paged KV cache with continuous batching.

from engine import LLM, SamplingParams
outputs = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, EngineStats
from engine.config import EngineArgs, EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from engine.pooler_config import PoolerConfig
from engine.pooling_params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
