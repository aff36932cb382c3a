"""The model runner: one batched forward pass per step, then sampling.

It owns the model, the per-layer KV caches and the sampler. From a `SchedulerOutput` it
builds flat tensors (decode tokens first, then prefill chunks), runs the model, computes
logits only where something is sampled (or prompt logprobs are asked for), pools the final
hidden states of pooling requests (engine/worker/pooler.py: LAST, MEAN or CLS, accumulated
over prefill chunks), and returns a `ModelRunnerOutput`.
Speculative entries (greedy, with draft tokens) are verified: see `_verify_drafts`.
On CUDA, pure decode steps replay captured CUDA graphs (engine/worker/cuda_graphs.py).
`execute` = `launch` (ends by starting the one host copy) then `finish` (async_output.py).

As a rank of a tensor/pipeline-parallel engine (engine/distributed/) it holds its share of
the model and of the KV cache; a stage before the last hands its output on and returns
None, and on the last stage only TP rank 0 samples (the others join its logits gathers).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from engine.attention.backend import get_attention_backend
from engine.attention.kv_cache_spec import PagedKVSpec
from engine.config.resolved import CacheConfig, EngineConfig
from engine.config.rope import rope_regime
from engine.core.sched_output import (
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine.distributed.parallel_state import get_parallel_rank
from engine.distributed.stage import stage_forward
from engine.layers.ops import select_op_impl
from engine.loader.model_loader import load_model
from engine.lora.manager import LoRAManager
from engine.sample import Sampler
from engine.sample.sampler import select_argmax
from engine.worker.async_output import PendingOutput, make_host_copy
from engine.worker.cuda_graphs import DecodeGraphs, graphs_unsupported_reason
from engine.worker.device_runtime import device_runtime
from engine.worker.inputs import StepInputs, build_step_inputs
from engine.worker.kv_memory import lazily_zeroed
from engine.worker.kv_sizing import determine_num_blocks
from engine.worker.malloc_tuning import keep_freed_memory_mapped
from engine.worker.placeholder_inputs import PlaceholderInputs
from engine.worker.pooler import Pooler
from engine.worker.profiler import TorchProfiler
from engine.worker.sleep import SleepMode
from engine.worker.step_rows import classify_rows
from engine.worker.step_sampler import StepSampler
from engine.worker.uploads import make_uploader

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, allocate_kv_cache: bool = True) -> None:
        """Loads the model and sizes the KV cache (`num_blocks`); allocates it and warms up
        unless `allocate_kv_cache` is False (a rank waits for the size all ranks agree on,
        then calls `initialize_kv_cache`)."""
        self.config = config
        self.ranks = get_parallel_rank()
        model_config = config.model_config
        self.device = torch.device(config.device_config.device)
        self.dtype: torch.dtype = getattr(torch, model_config.dtype)
        # The KV cache's element type (CacheConfig.cache_dtype, vLLM's kv_cache_dtype): the
        # model dtype, or a 16-bit type the attention backends round keys/values into.
        cache_dtype = config.cache_config.cache_dtype  # resolved by EngineArgs, or "auto"
        self.kv_cache_dtype: torch.dtype = getattr(
            torch, model_config.dtype if cache_dtype == "auto" else cache_dtype
        )
        self.block_size = config.cache_config.block_size
        self.vocab_size = model_config.vocab_size
        torch.manual_seed(model_config.seed)
        if self.device.type == "cpu":
            # Attention over zero-filled cache slots can leave subnormal activations, which
            # make x86 matmuls several times slower; flushing them changes no result above
            # 1e-38.
            torch.set_flush_denormal(True)
            keep_freed_memory_mapped()
        self.attn_backend = get_attention_backend(
            config.device_config.attention_backend,
            self.device,
            self.dtype,
            batch_invariant=config.batch_invariant,  # its loader then makes the linears so
        )
        self.model = load_model(
            model_config.model_dir,
            model_config.hf_config,
            dtype=self.dtype,
            device=self.device,
            attn_backend=self.attn_backend,
            quantization=model_config.quantization,
            gguf_file=model_config.gguf_file,
            load_format=model_config.load_format,
            seed=model_config.seed,
        )
        if self.kv_cache_dtype == torch.float8_e4m3fn and not isinstance(
            self.model.kv_cache_spec, PagedKVSpec
        ):  # MLA layers attend with torch ops over a latent cache: no FP8 reads there
            raise ValueError(
                "kv_cache_dtype='fp8' is served for paged key/value caches only, not for "
                f"{type(self.model.kv_cache_spec).__name__} (multi-head latent attention)."
            )
        # Whether the steps carry each token's rope length (longrope, dynamic: rope.py).
        self._rope_lengths = rope_regime(model_config.hf_config) is not None
        # The backend's fused whole-step path for one-token decode steps, if it has one.
        self._decode_step = None
        self.bind_decode_step()
        # The sampler sees fp32 logits whatever the model dtype: its argmax follows the ops'
        # choice for fp32 on this backend and device.
        logits_ops = select_op_impl(self.attn_backend.name, self.device, torch.float32)
        self.sampler = Sampler(select_argmax(logits_ops))
        self.step_sampler = StepSampler(self)  # sampling, drafts, prompt logprobs
        # Async scheduling: the step's one read to the host (pinned + event on a GPU) and
        # the sampled ids kept on the device for the next step's placeholder rows.
        self.host_copy = make_host_copy(self.device)
        self.upload = make_uploader(self.device, config.async_scheduling)  # uploads.py
        self.placeholder_inputs = PlaceholderInputs()
        self.pooler = Pooler(config.pooler_config.pooling_type or "LAST")
        self.profiler = TorchProfiler(self.device, self.ranks.rank)  # start/stop_profile()
        self.sleep_mode = SleepMode(self)  # sleep() / wake_up()
        self.lora_manager: LoRAManager | None = None  # set by the Worker with enable_lora
        # Memory figures and graph capture on a GPU; None on the CPU (device_runtime.py).
        self.runtime = device_runtime(self.device)
        self.cuda_graphs = self._make_decode_graphs()  # None: every step runs eagerly
        # Empty until initialize_kv_cache. Set before the sizing: the GPU budget's profile
        # step runs a forward on scratch caches, and _forward tells them from these.
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = self._determine_num_blocks(config.cache_config)
        if allocate_kv_cache:
            self.initialize_kv_cache(self.num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates `num_blocks` blocks per layer (at most what the budget allows) and
        runs the warm-up steps."""
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self._warm_up()
        self.capture_cuda_graphs()

    @property
    def is_driver_rank(self) -> bool:
        """The rank whose output the engine reads: TP rank 0 of the last stage."""
        return self.ranks.is_driver_worker

    @property
    def kv_cache_sliding_window(self) -> int | None:
        """The window behind which the KV-cache manager may free a request's blocks (every
        layer's window; None when any layer attends to the whole context)."""
        return self.model.kv_cache_sliding_window(self.config.model_config.hf_config)

    def bind_decode_step(self) -> None:
        """(Re)binds the backend's fused decode path to the current model and caches (it
        holds their addresses): after a wake-up. Not over several ranks: the fused path
        computes every layer in one call, with no collective between them."""
        if self.ranks.world_size == 1:
            self._decode_step = self.attn_backend.whole_step_decode(self.model)

    def unbind_decode_step(self) -> None:
        self._decode_step = None

    # ---- CUDA graphs (engine/worker/cuda_graphs.py) -------------------------------------

    def _make_decode_graphs(self) -> DecodeGraphs | None:
        graph_config = self.config.cuda_graph_config
        if not graph_config.enabled or self.runtime is None:  # CPU, enforce_eager, ...
            return None
        reason = graphs_unsupported_reason(
            self.attn_backend,
            self.model,
            self.ranks.world_size,
            lora=self.config.lora_config is not None,
        )
        if reason is not None:
            logger.info("CUDA graphs off: %s; decode steps run eagerly.", reason)
            return None
        max_len = self.config.scheduler_config.max_model_len
        return DecodeGraphs(
            graph_config, math.ceil(max_len / self.block_size), max_len, self.block_size,
            self.device, self.runtime,
        )  # fmt: skip

    @property
    def _num_pad_blocks(self) -> int:
        """Blocks past the scheduler's: the padding rows of a graph's batch write there."""
        return 1 if self.cuda_graphs is not None else 0

    def capture_cuda_graphs(self) -> None:
        """Captures the decode graphs over the current weights and caches (at start-up and
        after a wake-up); on a failure, logs it and runs eagerly from then on."""
        if self.cuda_graphs is None:
            return
        caches = self.kv_caches
        model = self.model

        def forward(ids: torch.Tensor, pos: torch.Tensor, metadata: Any) -> torch.Tensor:
            return model(ids, pos, caches, metadata)

        try:
            self.cuda_graphs.capture(forward, pad_block=self.num_blocks)
        except RuntimeError:
            logger.exception("CUDA graph capture failed; decode steps run eagerly.")
            self.cuda_graphs.release()
            self.cuda_graphs = None

    def release_cuda_graphs(self) -> None:
        """Drops the graphs: they hold the addresses of the weights and caches (sleep)."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.release()

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """One tensor per layer of the model's `kv_cache_spec` shape (num_blocks + the
        padding block of CUDA graphs; engine/attention/kv_cache_spec.py: [2, num_blocks,
        block_size, num_kv_heads, head_dim] for keys and values, [num_blocks, block_size,
        latent + rope] for MLA), in the cache dtype (`kv_cache_dtype`; DESIGN.md's "in the
        model dtype" is the default).

        Zeroed, not empty: padded positions of a gathered context are masked to weight 0,
        and 0 * NaN from uninitialised memory would still poison the sum.
        """
        # This rank's KV heads (the spec's) and this stage's layers.
        num_blocks += self._num_pad_blocks
        shape = self.model.kv_cache_spec.shape(num_blocks, self.block_size)
        num_layers = self.model.num_local_layers
        if self.device.type == "cpu":  # pages become resident as blocks are first used
            return [lazily_zeroed(shape, self.kv_cache_dtype) for _ in range(num_layers)]
        return [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            for _ in range(num_layers)
        ]

    @torch.inference_mode()
    def _dummy_forward(
        self, requests: list[tuple[list[int], int, list[int]]], kv_caches: list[torch.Tensor]
    ) -> None:
        """A forward pass (and the last row's logits) outside any scheduled step."""
        inputs = build_step_inputs(requests, self.block_size, self.device)
        hidden = self._forward(inputs, kv_caches)
        if hidden is not None:  # the last pipeline stage
            self.model.compute_logits(hidden[-1:])

    def _forward(
        self, inputs: StepInputs, kv_caches: list[torch.Tensor], fused: bool = True
    ) -> torch.Tensor | None:
        """The model's forward: a captured CUDA graph's replay, or the backend's fused path,
        where one applies to the step (neither with LoRA adapters in the batch: their
        updates hook the model's layers).
        Under pipeline parallelism, this stage's share; None before the last stage."""
        metadata = inputs.attn_metadata
        if self.cuda_graphs is not None and kv_caches is self.kv_caches:
            size = self.cuda_graphs.graph_size(metadata, eager_only=not fused)
            if size is not None:
                return self.cuda_graphs.replay(inputs, size)
        if fused and self._decode_step is not None and self._decode_step.applies(metadata):
            return self._decode_step(inputs.input_ids, inputs.positions, kv_caches, metadata)
        if self.ranks.pp_size > 1:
            hidden_size = self.config.model_config.hf_config.hidden_size
            return stage_forward(
                self.model,
                inputs.input_ids,
                inputs.positions,
                kv_caches,
                metadata,
                hidden_size,
                self.dtype,
            )
        return self.model(inputs.input_ids, inputs.positions, kv_caches, metadata)

    def _warm_up(self) -> None:
        """One small prefill and one decode step, so that library initialisation (oneDNN
        primitives, Triton compilation) is not paid by the first request. Writes only into
        block 0, whose contents a later owner overwrites before reading."""
        num_tokens = min(self.block_size, self.config.scheduler_config.max_model_len) - 1
        if num_tokens < 1:
            return
        self._dummy_forward([(self._dummy_tokens(num_tokens), 0, [0])], self.kv_caches)
        self._dummy_forward([([0], num_tokens, [0])], self.kv_caches)

    # ---- KV-cache sizing --------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        """This rank's bytes for one block in the cache dtype: its KV heads (or latent
        entries: the model's `kv_cache_spec`), its stage's layers."""
        elem = self.kv_cache_dtype.itemsize
        per_layer = self.block_size * self.model.kv_cache_spec.elements_per_token * elem
        return per_layer * self.model.num_local_layers

    def _determine_num_blocks(self, cache_config: CacheConfig) -> int:
        """Blocks from the memory budget (engine/worker/kv_sizing.py)."""
        return determine_num_blocks(
            cache_config,
            self.config.scheduler_config,
            self.kv_bytes_per_block,
            self._gpu_kv_budget if self.runtime is not None else None,
            self.block_size,
            str(self.kv_cache_dtype).removeprefix("torch."),
        )

    def _gpu_kv_budget(self, utilization: float) -> int:
        """Memory left for the cache after the model and a worst-case forward pass: this
        process's peak (weights + the profile step's activations and scratch cache) and
        what other processes hold, out of `utilization` of the device."""
        runtime = self.runtime
        assert runtime is not None
        runtime.empty_cache()
        runtime.reset_peak_memory_stats()
        self._profile_run()
        free, total = runtime.mem_get_info()
        peak = runtime.max_memory_allocated()
        other = total - free - runtime.memory_reserved()  # other processes
        return int(total * utilization) - peak - max(other, 0)

    def _profile_request(self) -> tuple[list[int], int, list[int]]:
        """The largest step the scheduler can make, as one prompt: (token ids, 0, blocks).
        The ids cycle through the vocabulary (_dummy_tokens): a tiny model's vocabulary can
        be smaller than the step, and an id past it is an out-of-bounds gather, on a GPU a
        device-side assert that poisons the process's CUDA context."""
        sched = self.config.scheduler_config
        num_tokens = min(sched.max_num_batched_tokens, sched.max_model_len)
        return (
            self._dummy_tokens(num_tokens),
            0,
            list(range(math.ceil(num_tokens / self.block_size))),
        )

    def _dummy_tokens(self, n: int) -> list[int]:
        """n token ids for a forward outside any request, all inside the vocabulary."""
        return [t % self.vocab_size for t in range(n)]

    def _profile_run(self) -> None:
        """The largest step the scheduler can make, on a scratch cache."""
        request = self._profile_request()
        caches = self._allocate_kv_caches(len(request[2]))
        self._dummy_forward([request], caches)
        del caches
        if self.runtime is not None:
            self.runtime.synchronize()

    # ---- the step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output; None on a rank that does not answer (an earlier pipeline
        stage, or a TP rank other than 0)."""
        pending = self.launch(scheduler_output)
        return None if pending is None else pending.finish()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput | None:
        """Inputs, forward and sampling; the sampled ids' copy to the host is started, not
        waited for: `PendingOutput.finish()` gives the output (engine/worker/async_output.py).
        None on a rank that does not answer."""
        rows = classify_rows(scheduler_output, self.step_sampler.wants_prompt_logprobs)
        batch = rows.batch
        inputs = self.upload.step_inputs(
            rows.requests,
            self.block_size,
            [e.request.rope_length for e in batch] if self._rope_lengths else None,
        )
        if rows.has_placeholders:  # async scheduling: ids sampled by the step before
            self.placeholder_inputs.fill(batch, inputs, self.upload)
        lora = self.lora_manager is not None and self.lora_manager.prepare(
            [(e.request.lora_request, len(e.token_ids)) for e in batch]
        )
        hidden = self._forward(inputs, self.kv_caches, fused=not lora)  # [num_tokens, hidden]
        if hidden is None:  # an earlier pipeline stage: the output went to the next one
            return None

        self.drop_request_state(scheduler_output)
        sampling, speculative, prompt_lp = rows.sampling, rows.speculative, rows.prompt_lp
        if not self.is_driver_rank:
            self.step_sampler.follow_logits(batch, sampling, speculative, prompt_lp, inputs, hidden)
            return None
        output = ModelRunnerOutput()
        finishers = []
        self.step_sampler.device_sampled = []
        if sampling:
            finishers.append(
                self.step_sampler.sample(batch, sampling, inputs, hidden, output, self.host_copy)
            )
        self.placeholder_inputs.remember(self.step_sampler.device_sampled)
        # The features below read the device themselves (not overlapped: the engine falls
        # back to synchronous steps for them, engine/core/async_scheduling.py).
        if speculative:
            self.step_sampler.verify_drafts(batch, speculative, inputs, hidden, output)
        if rows.pooling:
            self.pooler(batch, rows.pooling, inputs, hidden, output)
        for i in prompt_lp:
            self.step_sampler.prompt_logprobs(batch[i], inputs, i, hidden, output)
        return PendingOutput(output, finishers)

    def drop_request_state(self, scheduler_output: SchedulerOutput) -> None:
        """Forgets what the runner keeps for requests that finished or were preempted."""
        for ids in (scheduler_output.finished_request_ids, scheduler_output.preempted_request_ids):
            self.pooler.drop(ids)
            self.step_sampler.drop(ids)
