"""The resolved configuration of an engine: `EngineConfig` and its parts (model, cache,
scheduler, device), as `EngineArgs.create_engine_config` (engine_config.py) makes them once
at start-up. What the worker, scheduler and runner read; never "auto" here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.config.cuda_graph import CudaGraphConfig
from engine.config.kv_cache_dtype import CACHE_DTYPE_NAMES
from engine.config.lora import LoRAConfig
from engine.config.parallel import ParallelConfig
from engine.config.pooler import PoolerConfig
from engine.config.speculative import SpeculativeConfig

SchedulingPolicy = Literal["fcfs", "priority"]
FairnessPolicy = Literal["vtc", "off"]


@dataclass
class ModelConfig:
    model: str | None  # what the user asked for (None = the default model)
    model_dir: Path  # the resolved Hugging Face directory
    hf_config: Any  # transformers PretrainedConfig
    dtype: str  # resolved torch dtype name: "float32", "bfloat16" or "float16"
    max_model_len: int
    seed: int
    tokenizer_dir: Path | None = None  # None: the model directory
    skip_tokenizer_init: bool = False
    max_logprobs: int = 20
    eos_token_ids: set[int] = field(default_factory=set)
    generation_config: dict[str, Any] = field(default_factory=dict)
    # resolved: None, "gguf", "int8", or a quantized checkpoint's method ("fp8", "awq", "gptq")
    quantization: str | None = None
    gguf_file: Path | None = None  # the .gguf file the model came from, if it did
    load_format: str = "auto"  # "auto": the checkpoint; "dummy": random weights (benchmarks)
    # vLLM's --served-model-name: the names clients may use; the first is reported.
    served_model_names: list[str] = field(default_factory=list)

    @property
    def served_model_name(self) -> str:
        """The name reported in model info (the OpenAI door's model id), traces and metrics:
        the first served model name, else what was asked for, else the directory's name."""
        if self.served_model_names:
            return self.served_model_names[0]
        return self.model or self.model_dir.name

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        head_dim = getattr(cfg, "head_dim", None)
        return int(head_dim or cfg.hidden_size // cfg.num_attention_heads)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # explicit budget; else derived (see worker)
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's field: the KV cache's element type, a torch dtype name ("float32", "bfloat16",
    # "float16"), or "auto" = the model dtype. EngineArgs resolves it once (never "auto"
    # in an engine's config); see kv_cache_dtype.resolve_kv_cache_dtype.
    cache_dtype: str = "auto"
    # Decided once at start-up from the memory budget (ModelRunner); the engine's resolved
    # config is a copy carrying it. 0 in a config that no engine has resolved yet.
    num_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}."
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}."
            )
        if self.cache_dtype != "auto" and self.cache_dtype not in CACHE_DTYPE_NAMES:
            raise ValueError(
                f"cache_dtype must be 'auto' or a resolved dtype name, got {self.cache_dtype!r}."
            )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = "fcfs"
    max_loras: int | None = None  # distinct LoRA adapters among running requests; None: LoRA off
    # Sharing between fairness keys (tenants): "vtc" (the virtual token counter,
    # engine/core/fairness.py) or "off" (one queue, the policy alone). Requests without a
    # key share one, so "vtc" changes nothing for an engine without tenants.
    fairness: FairnessPolicy = "vtc"
    fairness_prompt_token_weight: float = 1.0  # VTC's cost of a computed prompt token
    fairness_output_token_weight: float = 2.0  # ... and of a generated token

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}."
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}."
            )
        if self.fairness not in ("vtc", "off"):
            raise ValueError(f"fairness must be 'vtc' or 'off', got {self.fairness!r}.")
        for name in ("fairness_prompt_token_weight", "fairness_output_token_weight"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled: "
                "a whole prompt must fit in one step."
            )


@dataclass
class DeviceConfig:
    device: str  # "cpu", "cuda", "cuda:1"...
    attention_backend: str | None = None  # None: triton on CUDA, cpu (else torch) on CPU


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    otlp_traces_endpoint: str | None = None
    speculative_config: SpeculativeConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig | None = None  # None: LoRA off
    # Resolved (every field set): how pooling requests pool. engine/config/pooler.py
    pooler_config: PoolerConfig = field(default_factory=lambda: PoolerConfig("LAST", True))
    # Decode batch sizes captured in CUDA graphs (engine/config/cuda_graph.py); empty: eager.
    cuda_graph_config: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    # Each row computed alike whatever the batch (engine/config/batch_invariant.py).
    batch_invariant: bool = False
    # The host schedules step N+1 while step N runs (engine/core/async_scheduling.py).
    async_scheduling: bool = False
