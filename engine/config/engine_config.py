"""Engine configuration: `EngineArgs` (what a user sets) and its resolution, once, into the
`EngineConfig` (resolved.py holds it and its parts; they are imported from here too).

Some parts resolve in their own modules: the device and dtype (device_dtype.py),
`ParallelConfig` (parallel.py), the KV cache's dtype (kv_cache_dtype.py) and the weight
quantization (quantization.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.batch_invariant import check_batch_invariant
from engine.config.cuda_graph import resolve_cuda_graph_config
from engine.config.device_dtype import resolve_device
from engine.config.hf_config import load_generation_dict, load_model_hf_config
from engine.config.kv_cache_dtype import check_fp8_kv_cache, resolve_kv_cache_dtype
from engine.config.lora import LoRAConfig
from engine.config.parallel import ExecutorBackend, ParallelConfig
from engine.config.pooler import PoolerConfig
from engine.config.resolved import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    FairnessPolicy,
    ModelConfig,
    SchedulerConfig,
    SchedulingPolicy,
)
from engine.config.rope import default_max_model_len, derived_max_model_len
from engine.config.speculative import SpeculativeConfig
from engine.config.step_budget import default_max_num_batched_tokens
from engine.config.weights.quantization import gguf_source
from engine.config.weights.weight_format import WeightRequest, resolve_weight_format

# Imported from this module by the engine's front end and the command's flags too.
__all__ = [
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "FairnessPolicy",
    "LoRAConfig",
    "ModelConfig",
    "SchedulerConfig",
    "SchedulingPolicy",
]


@dataclass
class EngineArgs:
    """Everything a user can set to build an engine (vLLM's names)."""

    model: str | None = None  # HF directory, .gguf file, or None for the default model
    tokenizer: str | None = None  # defaults to the model directory
    skip_tokenizer_init: bool = False
    # auto: on CPU bf16 where native, else fp32 (cpu_dtype.py); on GPU the checkpoint's bf16/fp16
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    # None: 2048 on GPU, max_num_seqs (256..2048) on CPU (engine/config/step_budget.py)
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    # The KV cache's dtype (vLLM's name): "auto" = the model dtype (float16 for GGUF blocks
    # kept quantized on the CPU, as llama.cpp: kv_cache_dtype.py), "bfloat16" / "float16"
    # (aliases "bf16", "fp16", "half") halve the cache's memory and the bytes attention
    # reads; keys and values are rounded once when written. "fp8" / "fp8_e4m3": E4M3 with
    # per-layer scales, the triton backend only (docs/fp8.md).
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    # Fair sharing between the requests' fairness keys (tenants): "vtc" or "off"; the
    # weights are VTC's cost of a computed prompt token and of a generated one (see
    # SchedulerConfig and docs/engine.md).
    fairness: FairnessPolicy = "vtc"
    fairness_prompt_token_weight: float = 1.0
    fairness_output_token_weight: float = 2.0
    device: str = "auto"
    attention_backend: str | None = None
    max_logprobs: int = 20
    disable_log_stats: bool = True
    otlp_traces_endpoint: str | None = None  # export llm_request spans here (OTLP)
    # e.g. {"method": "ngram", "num_speculative_tokens": 4}; None: no speculation
    speculative_config: dict[str, Any] | None = None
    # AsyncLLMEngine logs one line per request added / finished / aborted (vLLM's name).
    enable_log_requests: bool = False
    # vLLM's flag, accepted so that its sleep-mode code runs as written. vLLM needs it to put
    # the weights and KV cache in its own allocator's pool before sleep() can free them;
    # here sleep() frees plain tensors, so sleep mode works whether it is set or not.
    enable_sleep_mode: bool = False
    # LoRA adapters (vLLM's names): off unless enable_lora.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Weights kept quantized: "auto" (the default): "gguf" for a .gguf model (the default
    # model is one) on CPU in fp32, else None; None (or "none"): the checkpoint dtype (fp32
    # on CPU); "gguf" (the GGUF file's blocks); "int8" (per-channel weight-only). See
    # engine/layers/quantization.py. Blocks use a quarter to an eighth of fp32's memory and
    # decode faster at small batches; prefill and large batches dequantize chunks for MKL.
    # A checkpoint stored quantized (FP8: compressed-tensors, ModelOpt; INT4: AWQ, GPTQ;
    # engine/config/weights/checkpoint_quantization.py, docs/quantized_checkpoints.md) runs its own
    # method under "auto"/None or its name; another method is refused.
    quantization: str | None = "auto"
    # Pooling (vLLM's name): a PoolerConfig or {"pooling_type": "MEAN", "normalize": True};
    # unset fields come from a sentence-transformers model directory, else LAST, normalize.
    pooler_config: PoolerConfig | dict[str, Any] | None = None
    # Parallelism (vLLM's names; docs/parallelism.md): ranks are worker processes on
    # torch.distributed, gloo on CPU and NCCL on CUDA.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend | None = None
    # CUDA graphs for decode steps (vLLM's names; engine/worker/cuda_graphs.py): the batch
    # sizes to capture (None: vLLM's list 1, 2, 4, 8, 16, 24, ..., 512, capped by
    # max_num_seqs); enforce_eager=True turns graphs off. Always off on CPU.
    cuda_graph_sizes: list[int] | None = None
    enforce_eager: bool = False
    # vLLM's name: "auto" loads the checkpoint; "dummy" draws random weights on the device
    # and needs only the directory's config.json (engine/loader/dummy_weights.py): a real
    # model's shapes for benchmarks, without its files.
    load_format: str = "auto"
    # vLLM's name: the model's names in the API (one or more; the first is the one reported,
    # e.g. by the OpenAI door's /v1/models). None: `model` as given, else the directory's name.
    served_model_name: list[str] | str | None = None
    # Batch-invariant inference (docs/determinism.md): a request's tokens and logprobs are
    # bitwise the same alone or in any batch, chunked or not, after a prefix-cache hit, a
    # preemption or a migration. CPU, float32; costs some throughput. Off by default.
    batch_invariant: bool = False
    # vLLM's name: the host schedules and prepares step N+1 while step N runs on the device
    # (docs/engine.md "Async scheduling"); same tokens either way. Off by default until a
    # GPU measures it; steps whose requests need their tokens on the host first run
    # synchronously (engine/core/async_scheduling.py).
    async_scheduling: bool = False

    def create_engine_config(self) -> EngineConfig:
        # Converting a GGUF model loads torch: imported when a config is made, so importing
        # a config stays torch-free (the command's parser reads EngineArgs; .importlinter).
        from engine.loader.model_dir import resolve_model

        speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )
        pooler_config = PoolerConfig.from_value(self.pooler_config)
        device = resolve_device(self.device)
        model_dir = resolve_model(self.model)
        hf_config = load_model_hf_config(model_dir)
        if parallel_config.world_size > 1:
            # below config: a check made here only (.importlinter, contract `config`)
            from engine.distributed.sharding import verify_parallel_config

            verify_parallel_config(hf_config, parallel_config, self)
        gguf_file = gguf_source(self.model)
        dtype, quantization = resolve_weight_format(
            WeightRequest(self.dtype, self.quantization, self.load_format, self.batch_invariant),
            model_dir,
            hf_config,
            gguf_file,
            device,
            parallel_config.world_size,
        )
        max_pos = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
        max_len = derived_max_model_len(hf_config)  # max_pos, or stretched by the rope scaling
        max_model_len = self.max_model_len or default_max_model_len(hf_config)
        if max_model_len > max_len:
            scaled = "" if max_len == max_pos else f" with its rope scaling: {max_len}"
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's "
                f"max_position_embeddings ({max_pos}{scaled})."
            )
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}.")
        gen_config = load_generation_dict(model_dir)
        model_config = ModelConfig(
            model=self.model,
            model_dir=model_dir,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            tokenizer_dir=Path(self.tokenizer) if self.tokenizer else model_dir,
            served_model_names=_served_model_names(self.served_model_name),
            skip_tokenizer_init=self.skip_tokenizer_init,
            max_logprobs=self.max_logprobs,
            eos_token_ids=_eos_ids(gen_config, hf_config),
            generation_config=gen_config,
            quantization=quantization,
            gguf_file=gguf_file,
            load_format=self.load_format,
        )
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = default_max_num_batched_tokens(
                device, self.max_num_seqs, self.enable_chunked_prefill, max_model_len
            )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=resolve_kv_cache_dtype(
                self.kv_cache_dtype,
                dtype,
                gguf_blocks_on_cpu=quantization == "gguf" and device == "cpu",
            ),
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            fairness=self.fairness,
            fairness_prompt_token_weight=self.fairness_prompt_token_weight,
            fairness_output_token_weight=self.fairness_output_token_weight,
        )
        cuda_graph_config = resolve_cuda_graph_config(
            self.cuda_graph_sizes, self.enforce_eager, device, self.max_num_seqs
        )
        check_fp8_kv_cache(
            cache_config.cache_dtype,
            device=device,
            attention_backend=self.attention_backend,
            batch_invariant=self.batch_invariant,
        )
        if not isinstance(self.async_scheduling, bool):
            value = self.async_scheduling
            raise ValueError(f"async_scheduling must be True or False, got {value!r}.")
        if self.batch_invariant:
            check_batch_invariant(
                device=device,
                dtype=dtype,
                attention_backend=self.attention_backend,
                world_size=parallel_config.world_size,
                speculative=speculative_config is not None,
                lora=self.enable_lora,
            )
        lora_config = None
        if self.enable_lora:
            lora_config = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        return EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            DeviceConfig(device, self.attention_backend),
            otlp_traces_endpoint=self.otlp_traces_endpoint,
            speculative_config=speculative_config,
            parallel_config=parallel_config,
            lora_config=lora_config,
            pooler_config=pooler_config.resolve(model_dir),
            cuda_graph_config=cuda_graph_config,
            batch_invariant=self.batch_invariant,
            async_scheduling=self.async_scheduling,
        )


def _eos_ids(gen_config: dict[str, Any], hf_config: Any) -> set[int]:
    eos = gen_config.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list | tuple) else {int(eos)}


def _served_model_names(value: list[str] | str | None) -> list[str]:
    """`served_model_name` as a list (vLLM takes one name or several), each a non-empty
    string without surrounding blanks: a name clients must type exactly."""
    names = [value] if isinstance(value, str) else list(value or [])
    for name in names:
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ValueError(
                f"served_model_name must be non-empty names without surrounding spaces, "
                f"got {name!r}."
            )
    if len(set(names)) != len(names):
        raise ValueError(f"served_model_name lists a name twice: {names}.")
    return names
