"""Engine configuration: `EngineArgs` (what a user sets) resolved once into `EngineConfig` and its
parts (model, cache, scheduler, parallel, pooler, quantization, KV-cache dtype), one module each.

`from engine.config import EngineArgs, EngineConfig` (or from `engine`) is the public way in,
as `vllm.config` is vLLM's.
"""

from engine.config.engine_config import EngineArgs, EngineConfig

__all__ = ["EngineArgs", "EngineConfig"]
