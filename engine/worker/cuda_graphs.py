"""CUDA graphs for decode steps: capture the model's forward once per batch size, replay it.

A decode step of an 8B model launches ~10 kernels per layer from Python; at small batches
the launches cost more than the step's memory traffic. A CUDA graph records the launches
of one forward and replays them with one call. A graph replays fixed addresses and fixed
shapes, so:

- the step's inputs live in static buffers (`DecodeInputBuffers`) that every replay reads;
  a step copies its values into them in place;
- a graph serves one batch size: a step of n decode requests runs the graph of the smallest
  captured size >= n (`CudaGraphConfig.padded_size`), and its spare rows are padding;
- only pure decode steps (one query token per request) are captured. Prefill and mixed
  steps, LoRA steps and batches above the largest size run eagerly (`choose_graph_size`).

Padding rows are dummy requests of one token at position 0 whose key/value go to a block of
their own (the runner allocates one block past the scheduler's; `pad_block`), so they never
touch a real request's cache; their outputs are dropped::

    captured size 4, step of 3:   row   input  pos   slot             seq_len  block table
                                  0-2   the step's values (copied in place)
                                  3     0      0     pad_block * bs   1        [pad_block, 0..]

Host-side values a graph bakes in are set to bounds that hold for every later step: the
metadata's max_seq_len (and seq_lens_cpu) are max_model_len, so the attention kernel's
split-KV ranges cover any context. Only backends that declare `supports_cuda_graphs` are
captured (their launches read device tensors only).

Capture runs at start-up after the KV cache is allocated and the warm-up steps ran (Triton
compiled its kernels); sizes are captured largest first into one memory pool, as vLLM does,
so the smaller graphs reuse the larger ones' memory. Sleep drops the graphs (they hold the
addresses of the weights and the cache) and wake-up captures them again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.config.cuda_graph import CudaGraphConfig
from engine.layers.moe import FusedMoE
from engine.worker.device_runtime import DeviceRuntime, Replay
from engine.worker.inputs import StepInputs

logger = logging.getLogger(__name__)

# forward(input_ids [n], positions [n], metadata) -> hidden [n, hidden_size]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def is_pure_decode(metadata: AttentionMetadata) -> bool:
    """One query token per request, and no request of another kind."""
    return metadata.num_decodes == metadata.num_reqs == metadata.num_actual_tokens


def choose_graph_size(
    config: CudaGraphConfig,
    metadata: AttentionMetadata,
    eager_only: bool = False,
    max_blocks_per_req: int | None = None,
) -> int | None:
    """The captured size a step replays at, or None to run it eagerly: a prefill or mixed
    step, a step that must run eagerly (`eager_only`: LoRA adapters in the batch, whose
    updates hook the layers from Python), a batch above the largest captured size, or block
    tables wider than the buffers' `max_blocks_per_req` (a request may hold blocks
    allocated ahead for draft tokens past max_model_len)."""
    if eager_only or not config.enabled or not is_pure_decode(metadata):
        return None
    if max_blocks_per_req is not None and metadata.block_tables.shape[1] > max_blocks_per_req:
        return None
    return config.padded_size(metadata.num_reqs)


def graphs_unsupported_reason(
    attn_backend: AttentionBackend, model: torch.nn.Module, world_size: int, lora: bool
) -> str | None:
    """Why this engine's decode steps cannot be captured at all, or None. Each reason is
    something the forward does on the host that a replay would not redo."""
    if not attn_backend.supports_cuda_graphs:
        return f"the {attn_backend.name!r} attention backend reads host values per request"
    if world_size > 1:
        return "tensor/pipeline parallelism (collectives are not captured yet)"
    if lora:
        return "enable_lora (adapter indices are chosen on the host per step)"

    if any(isinstance(m, FusedMoE) for m in model.modules()):
        return "a mixture-of-experts model (routing reads expert counts on the host)"
    return None


class DecodeInputBuffers:
    """The static inputs every captured graph reads, updated in place each step.

    Rows past the step's requests stay in the padding state (see the module docstring), so
    a graph of any size >= the step reads valid padding. Layout (int64 ids, positions and
    slots; int32 lengths and tables, as `build_step_inputs` makes them)::

        input_ids       [max_batch]
        positions       [max_batch]
        slot_mapping    [max_batch]
        seq_lens        [max_batch]
        query_start_loc [max_batch + 1]      0, 1, 2, ...: one token per request, fixed
        block_tables    [max_batch, max_blocks_per_req]

    `load` writes only what changed since the previous step: the step's rows, the rows a
    larger previous step left (reset to padding), and the table columns a wider previous
    step left (zeroed). Every captured graph reads slices of these same tensors.
    """

    def __init__(
        self,
        max_batch: int,
        max_blocks_per_req: int,
        pad_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_batch, self.max_blocks_per_req = max_batch, max_blocks_per_req
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_batch,), self.pad_slot, dtype=i64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=i32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_req, dtype=i32, device=device)
        self.block_tables[:, 0] = pad_block
        self._rows = 0  # rows [0, _rows) hold a step's values; the rest are padding
        self._width = 0  # columns [0, _width) of those rows may be non-zero

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """The metadata of a graph of `size` rows: views of the buffers, and host bounds
        (`max_seq_len`) that hold for every step the graph will replay."""
        return AttentionMetadata(
            num_actual_tokens=size,
            num_decodes=size,
            num_decode_tokens=size,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[max_seq_len] * size,
        )

    def load(self, inputs: StepInputs) -> int:
        """Copies a pure decode step's inputs into the buffers; returns its row count."""
        metadata = inputs.attn_metadata
        n, width = metadata.num_reqs, metadata.block_tables.shape[1]
        if n > self.max_batch or width > self.max_blocks_per_req:
            raise ValueError(
                f"a decode step of {n} requests x {width} blocks exceeds the graph buffers "
                f"({self.max_batch} x {self.max_blocks_per_req})"
            )
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        if self._width > width:  # a wider previous step's blocks: stale, zeroed
            self.block_tables[:n, width : self._width].zero_()
        if self._rows > n:  # rows a larger previous step used: back to padding
            self._pad_rows(n, self._rows)
        self._rows, self._width = n, width
        return n

    def _pad_rows(self, start: int, end: int) -> None:
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(self.pad_slot)
        self.seq_lens[start:end].fill_(1)
        self.block_tables[start:end].zero_()
        self.block_tables[start:end, 0] = self.pad_block


class DecodeGraphs:
    """The captured decode graphs of one runner, by batch size."""

    def __init__(
        self,
        config: CudaGraphConfig,
        max_blocks_per_req: int,
        max_seq_len: int,
        block_size: int,
        device: torch.device,
        runtime: DeviceRuntime,
    ) -> None:
        self.config = config
        self.max_blocks_per_req, self.max_seq_len = max_blocks_per_req, max_seq_len
        self.block_size, self.device = block_size, device
        self.runtime = runtime  # torch.cuda on a GPU (engine/worker/device_runtime.py)
        self.buffers: DecodeInputBuffers | None = None
        self._graphs: dict[int, tuple[Replay, torch.Tensor]] = {}  # size -> (replay, output)
        self._pool: Any = None
        self.num_replays = 0  # steps served by a graph (tests and the stats read it)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def graph_size(self, metadata: AttentionMetadata, eager_only: bool = False) -> int | None:
        """The captured graph a step replays (None: eager). Nothing before capture."""
        if not self._graphs:
            return None
        size = choose_graph_size(self.config, metadata, eager_only, self.max_blocks_per_req)
        return size if size in self._graphs else None

    @torch.inference_mode()
    def capture(self, forward: DecodeForward, pad_block: int) -> None:
        """Captures every configured size, largest first; `forward` runs the model over the
        runner's current weights and KV caches (their addresses are baked in)."""
        self.release()
        self.buffers = DecodeInputBuffers(
            self.config.max_capture_size,
            self.max_blocks_per_req,
            pad_block,
            self.block_size,
            self.device,
        )
        runtime = self.runtime
        start = time.perf_counter()
        free_before = runtime.mem_get_info()[0]
        self._pool = runtime.graph_pool()
        for size in reversed(self.config.capture_sizes):
            metadata = self.buffers.metadata(size, self.max_seq_len)
            input_ids, positions = self.buffers.input_ids[:size], self.buffers.positions[:size]
            # An eager run first: Triton compiles (and picks) the kernels of this shape
            # outside the capture, which must record launches only. Every row is padding:
            # it writes only the padding block.
            forward(input_ids, positions, metadata)
            runtime.synchronize()
            self._graphs[size] = runtime.capture_graph(
                # bound now: the runtime may call it again (a replay that reruns it)
                lambda i=input_ids, p=positions, m=metadata: forward(i, p, m),  # [size, hidden]
                self._pool,
            )
        runtime.synchronize()
        used = free_before - runtime.mem_get_info()[0]
        logger.info(
            "Captured %d CUDA graphs for decode batches of %d..%d in %.1f s (%.0f MiB).",
            len(self._graphs),
            self.config.capture_sizes[0],
            self.config.max_capture_size,
            time.perf_counter() - start,
            used / 2**20,
        )

    def replay(self, inputs: StepInputs, size: int) -> torch.Tensor:
        """The step's hidden states [num_reqs, hidden_size]: a view of the graph's output,
        valid until the next replay."""
        assert self.buffers is not None
        n = self.buffers.load(inputs)
        replay, output = self._graphs[size]
        replay()
        self.num_replays += 1
        return output[:n]

    def release(self) -> None:
        """Drops the graphs and their memory pool (before the weights or the cache move)."""
        self._graphs.clear()
        self._pool = None
        self.buffers = None
