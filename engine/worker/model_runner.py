"""The model runner: one batched forward pass per step, then sampling.

It owns the model, the per-layer KV caches and the sampler. From a `SchedulerOutput` it
builds flat tensors (decode tokens first, then prefill chunks), runs the model, computes
logits only where something is sampled (or prompt logprobs are asked for), pools the final
hidden states of pooling requests (engine/worker/pooler.py: LAST, MEAN or CLS, accumulated
over prefill chunks), and returns a `ModelRunnerOutput`.
Speculative entries (greedy, with draft tokens) are verified: see `_verify_drafts`.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
from typing import Any

import torch

from engine.attention.backend import get_attention_backend
from engine.config import (
    CacheConfig,
    EngineConfig,
    default_cpu_kv_cache_bytes,
)
from engine.core.sched_output import (
    LogprobsLists,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from engine.lora.manager import LoRAManager
from engine.models.loader import load_model
from engine.models.ops import select_op_impl
from engine.sample import Sampler, SamplingMetadata, SamplingRow, gather_logprobs
from engine.sample.sampler import select_argmax
from engine.sample.token_controls import apply_grammar_bitmask_
from engine.worker.inputs import StepInputs, build_step_inputs
from engine.worker.kv_memory import lazily_zeroed
from engine.worker.pooler import Pooler
from engine.worker.profiler import TorchProfiler
from engine.worker.sleep import SleepMode

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
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
            _keep_freed_memory_mapped()
        self.attn_backend = get_attention_backend(
            config.device_config.attention_backend, self.device, self.dtype
        )
        self.model = load_model(
            model_config.model_dir,
            model_config.hf_config,
            dtype=self.dtype,
            device=self.device,
            attn_backend=self.attn_backend,
            quantization=model_config.quantization,
            gguf_file=model_config.gguf_file,
        )
        # The backend's fused whole-step path for one-token decode steps, if it has one.
        self._decode_step = self.attn_backend.whole_step_decode(self.model)
        # The sampler sees fp32 logits whatever the model dtype: its argmax follows the ops'
        # choice for fp32 on this backend and device.
        logits_ops = select_op_impl(self.attn_backend.name, self.device, torch.float32)
        self.sampler = Sampler(select_argmax(logits_ops))
        self.pooler = Pooler(config.pooler_config.pooling_type or "LAST")
        self.profiler = TorchProfiler(self.device)  # start_profile() / stop_profile()
        self.sleep_mode = SleepMode(self)  # sleep() / wake_up()
        self.lora_manager: LoRAManager | None = None  # set by the engine with enable_lora
        self.num_blocks = self._determine_num_blocks(config.cache_config)
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self._warm_up()

    @property
    def kv_cache_sliding_window(self) -> int | None:
        """The window behind which the KV-cache manager may free a request's blocks (every
        layer's window; None when any layer attends to the whole context)."""
        return self.model.kv_cache_sliding_window(self.config.model_config.hf_config)

    def bind_decode_step(self) -> None:
        """(Re)binds the backend's fused decode path to the current model and caches (it
        holds their addresses): after a wake-up."""
        self._decode_step = self.attn_backend.whole_step_decode(self.model)

    def unbind_decode_step(self) -> None:
        self._decode_step = None

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer, in the
        cache dtype (`kv_cache_dtype`; DESIGN.md's "in the model dtype" is the default).

        Zeroed, not empty: padded positions of a gathered context are masked to weight 0,
        and 0 * NaN from uninitialised memory would still poison the sum.
        """
        mc = self.config.model_config
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        if self.device.type == "cpu":  # pages become resident as blocks are first used
            return [lazily_zeroed(shape, self.kv_cache_dtype) for _ in range(mc.num_layers)]
        return [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            for _ in range(mc.num_layers)
        ]

    @torch.inference_mode()
    def _dummy_forward(
        self, requests: list[tuple[list[int], int, list[int]]], kv_caches: list[torch.Tensor]
    ) -> None:
        """A forward pass (and the last row's logits) outside any scheduled step."""
        inputs = build_step_inputs(requests, self.block_size, self.device)
        hidden = self._forward(inputs, kv_caches)
        self.model.compute_logits(hidden[-1:])

    def _forward(
        self, inputs: StepInputs, kv_caches: list[torch.Tensor], fused: bool = True
    ) -> torch.Tensor:
        """The model's forward, or the backend's fused path where it applies to the step
        (not with LoRA adapters in the batch: their updates hook the model's layers)."""
        metadata = inputs.attn_metadata
        if fused and self._decode_step is not None and self._decode_step.applies(metadata):
            return self._decode_step(inputs.input_ids, inputs.positions, kv_caches, metadata)
        return self.model(inputs.input_ids, inputs.positions, kv_caches, metadata)

    def _warm_up(self) -> None:
        """One small prefill and one decode step, so that library initialisation (oneDNN
        primitives, Triton compilation) is not paid by the first request. Writes only into
        block 0, whose contents a later owner overwrites before reading."""
        num_tokens = min(self.block_size, self.config.scheduler_config.max_model_len) - 1
        if num_tokens < 1:
            return
        self._dummy_forward([(list(range(num_tokens)), 0, [0])], self.kv_caches)
        self._dummy_forward([([0], num_tokens, [0])], self.kv_caches)

    # ---- KV-cache sizing --------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        """Keys and values of one block in every layer, in the cache dtype."""
        mc = self.config.model_config
        elem = self.kv_cache_dtype.itemsize
        return 2 * self.block_size * mc.num_kv_heads * mc.head_dim * elem * mc.num_layers

    def _determine_num_blocks(self, cache_config: CacheConfig) -> int:
        """Blocks from the memory budget: an explicit byte budget, the free GPU memory
        times `gpu_memory_utilization`, or the CPU budget (what the scheduler can use,
        capped by the available memory: config.default_cpu_kv_cache_bytes). Never more
        than the scheduler could ever use (max_num_seqs full-length sequences)."""
        per_block = self.kv_bytes_per_block
        sched = self.config.scheduler_config
        max_useful = sched.max_num_seqs * math.ceil(sched.max_model_len / self.block_size)
        if cache_config.num_gpu_blocks_override is not None:
            num_blocks = cache_config.num_gpu_blocks_override
            source = "num_gpu_blocks_override"
        else:
            if cache_config.kv_cache_memory_bytes is not None:
                budget, source = cache_config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
            elif self.device.type == "cuda":
                budget, source = self._gpu_kv_budget(cache_config.gpu_memory_utilization), "GPU"
            else:
                budget = default_cpu_kv_cache_bytes(max_useful * per_block)
                source = "CPU budget"
            num_blocks = budget // per_block
            num_blocks = min(num_blocks, max_useful)
        if num_blocks < 1:
            raise ValueError(
                f"The KV-cache budget ({source}) holds no block of {per_block} bytes; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization."
            )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB of %s (%s)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_blocks * per_block / 2**20,
            str(self.kv_cache_dtype).removeprefix("torch."),
            source,
        )
        return num_blocks

    def _gpu_kv_budget(self, utilization: float) -> int:
        """Memory left for the cache after the model and a worst-case forward pass."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        other = total - free - torch.cuda.memory_reserved(self.device)  # other processes
        return int(total * utilization) - peak - max(other, 0)

    def _profile_run(self) -> None:
        """The largest step the scheduler can make, on a scratch cache."""
        sched = self.config.scheduler_config
        num_tokens = min(sched.max_num_batched_tokens, sched.max_model_len)
        num_blocks = math.ceil(num_tokens / self.block_size)
        caches = self._allocate_kv_caches(num_blocks)
        self._dummy_forward([(list(range(num_tokens)), 0, list(range(num_blocks)))], caches)
        del caches
        torch.cuda.synchronize(self.device)

    # ---- the step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Decode tokens (one query token) first, then prefill chunks: the layout the
        # attention backends expect.
        batch = sorted(scheduler_output.scheduled, key=lambda e: e.num_new_tokens != 1)
        inputs = build_step_inputs(
            [(e.token_ids, e.num_computed_tokens, e.block_ids) for e in batch],
            self.block_size,
            self.device,
        )
        lora = self.lora_manager is not None and self.lora_manager.prepare(
            [(e.request.lora_request, len(e.token_ids)) for e in batch]
        )
        hidden = self._forward(inputs, self.kv_caches, fused=not lora)  # [num_tokens, hidden]

        sampling = [i for i, e in enumerate(batch) if e.samples and not e.spec_token_ids]
        speculative = [i for i, e in enumerate(batch) if e.spec_token_ids]
        # Every chunk of a pooling request's prompt: MEAN and CLS accumulate over chunks.
        self.pooler.drop(scheduler_output.finished_request_ids)
        self.pooler.drop(scheduler_output.preempted_request_ids)
        pooling = [i for i, e in enumerate(batch) if e.request.is_pooling]
        prompt_lp = [i for i, e in enumerate(batch) if self._wants_prompt_logprobs(e)]
        output = ModelRunnerOutput()
        if sampling:
            self._sample(batch, sampling, inputs, hidden, output)
        if speculative:
            self._verify_drafts(batch, speculative, inputs, hidden, output)
        if pooling:
            self.pooler(batch, pooling, inputs, hidden, output)
        for i in prompt_lp:
            self._prompt_logprobs(batch[i], inputs, i, hidden, output)
        return output

    def _sample(
        self,
        batch: list[ScheduledRequest],
        rows: list[int],
        inputs: StepInputs,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        last_token = torch.tensor(
            [inputs.query_start_loc_cpu[i + 1] - 1 for i in rows], device=self.device
        )
        logits = self.model.compute_logits(hidden[last_token])  # [num_rows, vocab] fp32
        entries = [batch[i] for i in rows]
        metadata = SamplingMetadata.build(
            [
                SamplingRow(
                    params=e.request.sampling_params,  # type: ignore[arg-type]
                    prompt_token_ids=e.request.prompt_token_ids,
                    output_token_ids=e.request.output_token_ids,
                    seed=e.request.seed,
                    grammar=_matcher(e.request),
                )
                for e in entries
            ],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        result = self.sampler(logits, metadata)
        sampled = result.sampled_token_ids.tolist()
        for row, entry in enumerate(entries):
            output.sampled_token_ids[entry.request_id] = sampled[row]
        if result.logprobs is None:
            return
        token_ids = result.logprobs.token_ids.tolist()
        values = result.logprobs.logprobs.tolist()
        ranks = result.logprobs.ranks.tolist()
        for row, entry in enumerate(entries):
            k = entry.request.sampling_params.logprobs  # type: ignore[union-attr]
            if k is not None:
                output.logprobs[entry.request_id] = LogprobsLists(
                    [token_ids[row][: k + 1]], [values[row][: k + 1]], [ranks[row]]
                )

    def _verify_drafts(
        self,
        batch: list[ScheduledRequest],
        rows: list[int],
        inputs: StepInputs,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Greedy verification of k drafts from the logits at the k + 1 positions::

            input     t  d0 d1 d2        (last known token, then the drafts)
            argmax    a0 a1 a2 a3        a_i: the greedy token after input position i
            accepted  d0 d1 while d_i == a_i; output = accepted drafts + the next a_i

        So the output is exactly what greedy decoding one token at a time produces.
        """
        positions: list[int] = []
        for i in rows:
            first = inputs.query_start_loc_cpu[i]
            positions.extend(range(first, inputs.query_start_loc_cpu[i + 1]))
        index = torch.tensor(positions, device=self.device)
        logits = self.model.compute_logits(hidden[index])  # [sum(k + 1), vocab] fp32
        logits = _mask_drafts(logits, [batch[i] for i in rows])
        argmax = logits.argmax(dim=-1).tolist()
        offset = 0
        for i in rows:
            entry = batch[i]
            drafts = entry.spec_token_ids
            greedy = argmax[offset : offset + len(drafts) + 1]
            offset += len(drafts) + 1
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == greedy[num_accepted]:
                num_accepted += 1
            output.spec_output_token_ids[entry.request_id] = greedy[: num_accepted + 1]

    @staticmethod
    def _wants_prompt_logprobs(entry: ScheduledRequest) -> bool:
        # Positions whose logits predict a *prompt* token: p with p + 1 < num_prompt_tokens.
        params = entry.request.sampling_params
        return (
            params is not None
            and params.prompt_logprobs is not None
            and entry.num_computed_tokens + 1 < entry.request.num_prompt_tokens
        )

    def _prompt_logprobs(
        self,
        entry: ScheduledRequest,
        inputs: StepInputs,
        row: int,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        request = entry.request
        start = entry.num_computed_tokens
        end = min(start + entry.num_new_tokens, request.num_prompt_tokens - 1)
        first = inputs.query_start_loc_cpu[row]
        logits = self.model.compute_logits(hidden[first : first + end - start])
        logprobs = torch.log_softmax(logits, dim=-1)  # [end - start, vocab]
        targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], device=self.device)
        assert request.sampling_params is not None
        k = request.sampling_params.prompt_logprobs
        assert k is not None
        tensors = gather_logprobs(logprobs, targets, k)
        output.prompt_logprobs[request.request_id] = (
            start + 1,
            LogprobsLists(
                tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
            ),
        )


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _matcher(request: Any) -> Any:
    """The request's grammar matcher under structured outputs, else None."""
    state = request.structured_output
    return None if state is None else state.matcher


def _mask_drafts(logits: torch.Tensor, entries: list[ScheduledRequest]) -> torch.Tensor:
    """Grammar masks for the k + 1 verification positions of constrained requests.

    The mask at position i is the grammar's after drafts d0..d(i-1): the matcher walks the
    drafts (stopping at the first it refuses, which the masked argmax then rejects too)
    and rolls back, so verification picks exactly the tokens constrained greedy decoding
    would. logits: [sum(k + 1), V].
    """
    constrained = [(e, _matcher(e.request)) for e in entries]
    num_positions = sum(len(e.spec_token_ids) + 1 for e, m in constrained if m is not None)
    if not num_positions:
        return logits
    # Only the constrained requests' positions get a mask row, applied in place.
    bitmask = torch.full((num_positions, -(-logits.shape[1] // 32)), -1, dtype=torch.int32)
    row_ids: list[int] = []
    offset = 0
    for entry, matcher in constrained:
        drafts = entry.spec_token_ids
        if matcher is not None:
            num_walked = 0
            for i in range(len(drafts) + 1):
                matcher.fill_bitmask(bitmask, len(row_ids) + i)
                if i == len(drafts) or not matcher.accept_token(drafts[i]):
                    break
                num_walked += 1
            matcher.rollback(num_walked)
            row_ids.extend(range(offset, offset + len(drafts) + 1))
        offset += len(drafts) + 1
    rows = torch.tensor(row_ids, dtype=torch.int64, device=logits.device)
    return apply_grammar_bitmask_(logits, bitmask, rows)


def _keep_freed_memory_mapped() -> None:
    """Stops glibc from handing large freed blocks back to the kernel between steps.

    A prefill step's temporaries are tens of MB each ([2048, 3072] fp32 is 25 MB). By default
    glibc serves such sizes with mmap (or trims them off the heap top) and returns them on
    free, so every step page-faults them in again, which costs about as much as the
    elementwise op that writes them. With a fixed 32 MiB mmap threshold (glibc's 64-bit
    maximum) and a 512 MiB trim threshold they stay mapped and are reused. Process-wide and
    harmless elsewhere; a no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 512 << 20)
    except (OSError, AttributeError):  # musl and other C libraries
        return
