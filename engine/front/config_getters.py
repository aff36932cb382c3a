"""`LLMEngine`'s config getters (vLLM's names), split out of engine/front/llm_engine.py."""

from __future__ import annotations

from typing import Any

from engine.config.engine_config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine.config.parallel import ParallelConfig
from engine.structured_output.config import DecodingConfig


class LLMEngineConfigGetters:
    # What these methods use of LLMEngine: attributes its __init__ sets.
    config: EngineConfig
    structured_output_manager: Any  # engine.structured_output.manager.StructuredOutputManager

    def get_model_config(self) -> ModelConfig:
        return self.config.model_config

    def get_cache_config(self) -> CacheConfig:
        return self.config.cache_config

    def get_scheduler_config(self) -> SchedulerConfig:
        return self.config.scheduler_config

    def get_device_config(self) -> DeviceConfig:
        return self.config.device_config

    def get_engine_config(self) -> EngineConfig:
        return self.config

    def get_decoding_config(self) -> DecodingConfig:
        """Which grammar backend enforces structured outputs."""
        return self.structured_output_manager.decoding_config

    def get_parallel_config(self) -> ParallelConfig:
        return self.config.parallel_config
