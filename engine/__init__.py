"""pagedserve's inference engine: vLLM's API over a paged KV cache with continuous batching.

from engine import LLM, SamplingParams
outputs = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=16))

The names below are imported on first use (PEP 562), not with the package: `import
engine.api.detokenizer` or `from engine.api.errors import EngineDeadError` must not load
torch, because the tokenizer service (the tier that scales out) imports those and never torch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# libgomp, torch's OpenMP runtime, reads how long an idle thread spins before it sleeps once,
# when torch loads it (so here, before anything imports torch). Its default (300,000 spins)
# makes every parallel region's barrier wait out a thread another process has descheduled:
# on a 2-core host with a busy neighbour per core an offline run took 3.9x its quiet time
# (median; up to 8.5x), against 2.6x with 10,000, which costs nothing measurable on a quiet
# host (docs/benchmarks.md, "Noisy neighbours"). A value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncLLMEngine": "engine.front.async_llm_engine",
    "EngineStats": "engine.front.engine_commands",
    "LLMEngine": "engine.front.llm_engine",
    "EngineDeadError": "engine.api.errors",
    "EngineArgs": "engine.config.engine_config",
    "EngineConfig": "engine.config.resolved",
    "LoRARequest": "engine.lora.request",
    "CompletionOutput": "engine.api.outputs",
    "Logprob": "engine.api.outputs",
    "PoolingOutput": "engine.api.outputs",
    "PoolingRequestOutput": "engine.api.outputs",
    "RequestMetrics": "engine.api.outputs",
    "RequestOutput": "engine.api.outputs",
    "PoolerConfig": "engine.config.pooler",
    "PoolingParams": "engine.pooling_params",
    "RequestOutputKind": "engine.api.sampling_params",
    "SamplingParams": "engine.api.sampling_params",
    "BeamSearchParams": "engine.api.sampling_params",
    "StructuredOutputsParams": "engine.api.sampling_params",
}

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "BeamSearchParams",
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
    "StructuredOutputsParams",
]

if TYPE_CHECKING:
    from engine.api.errors import EngineDeadError
    from engine.api.outputs import (
        CompletionOutput,
        Logprob,
        PoolingOutput,
        PoolingRequestOutput,
        RequestMetrics,
        RequestOutput,
    )
    from engine.api.sampling_params import (
        BeamSearchParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )
    from engine.config.engine_config import EngineArgs
    from engine.config.pooler import PoolerConfig
    from engine.config.resolved import EngineConfig
    from engine.front.async_llm_engine import AsyncLLMEngine
    from engine.front.engine_commands import EngineStats
    from engine.front.llm_engine import LLMEngine
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.pooling_params import PoolingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
