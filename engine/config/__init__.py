"""Engine configuration: `EngineArgs` (what a user sets) resolved once into `EngineConfig` and its
parts (model, cache, scheduler, parallel, pooler, quantization, KV-cache dtype), one module each.

`EngineArgs` and `EngineConfig` are imported from this package (or from `engine`), as vLLM's
are from `vllm.config`.
"""

from engine.config.engine_config import EngineArgs
from engine.config.resolved import EngineConfig

__all__ = ["EngineArgs", "EngineConfig"]
