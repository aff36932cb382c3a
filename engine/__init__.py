"""pagedserve's inference engine: vLLM's API over a paged KV cache with continuous batching.

from engine import LLM, SamplingParams
outputs = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from engine.config.engine_config import EngineArgs, EngineConfig
from engine.config.pooler import PoolerConfig
from engine.front.async_llm_engine import AsyncLLMEngine, EngineDeadError, EngineStats
from engine.front.llm_engine import LLMEngine
from engine.llm import LLM
from engine.lora.request import LoRARequest
from engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
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
