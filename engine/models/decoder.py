"""The decoder-only causal LM every dense family builds on: embedding, a stack of
`DecoderLayer`s, final norm, logits; weights through the generic loader.

A family is a subclass that sets its `DecoderSpec` from the config (and, where its
checkpoint differs, `packed_modules_mapping`): see llama.py, qwen2.py, qwen3.py, phi3.py.
`forward` returns final-norm hidden states; `compute_logits` projects the chosen rows.

Under pipeline parallelism a stage builds only its layers (the others are placeholders
without weights) and hands `(hidden, residual)` to the next stage; under tensor
parallelism the embedding and LM head hold this rank's vocabulary rows and the logits are
gathered on the rank that samples (engine/distributed/).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.kv_cache_spec import KVCacheSpec, PagedKVSpec
from engine.distributed.communication import tp_gather_last_dim
from engine.distributed.parallel_state import get_parallel_rank
from engine.distributed.sharding import layer_range
from engine.layers.decoder_layers import (
    DecoderLayer,
    DecoderSpec,
    GatedMLP,
    get_head_dim,
    layer_sliding_windows,
)
from engine.layers.greedy_screen import GreedyScreen
from engine.layers.linear import can_pack, linear, pack_linear_weights
from engine.layers.linear_select import LinearPlan, make_plan, select_methods
from engine.layers.ops import OpImpl, RMSNorm
from engine.layers.parallel_layers import VocabParallelEmbedding, post_load
from engine.layers.rope import RotaryEmbedding, rope_parameters
from engine.loader.weight_loader import load_weights
from engine.native import native_kernels_available
from engine.native.quant import fp32_weight

if TYPE_CHECKING:
    from engine.layers.greedy_screen import GreedyScreen


class PPMissingLayer(nn.Identity):
    """Stands for a layer that another pipeline stage computes: no weights, never called."""


# What a stage hands the next: (hidden, residual), each [T, hidden_size].
IntermediateTensors = tuple[torch.Tensor, torch.Tensor]


class DecoderModel(nn.Module):
    def __init__(
        self, hf_config: Any, spec: DecoderSpec, attn_backend: AttentionBackend, impl: OpImpl
    ) -> None:
        super().__init__()
        ranks = get_parallel_rank()
        num_layers = hf_config.num_hidden_layers
        self.start_layer, self.end_layer = layer_range(num_layers, ranks.pp_rank, ranks.pp_size)
        self.is_first_stage, self.is_last_stage = ranks.is_first_stage, ranks.is_last_stage
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.embed_tokens: nn.Module | None = None
        if self.is_first_stage or (self.is_last_stage and tied):  # the tied LM head
            self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        windows = layer_sliding_windows(hf_config)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, spec, attn_backend, impl, window, layer_idx)
            if self.start_layer <= layer_idx < self.end_layer
            else PPMissingLayer()
            for layer_idx, window in enumerate(windows)
        )
        self.norm: nn.Module | None = None  # the last stage's
        if self.is_last_stage:
            self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, impl)
        self.rotary_emb = RotaryEmbedding.from_parameters(
            get_head_dim(hf_config),
            hf_config.max_position_embeddings,
            rope_parameters(hf_config),
            impl,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # this stage's layers' caches
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # from the previous stage
    ) -> torch.Tensor | IntermediateTensors:  # [T, hidden_size], or to the next stage
        residual: torch.Tensor | None
        if intermediate is None:
            assert self.embed_tokens is not None, "only the first stage embeds"
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden_size]
        else:
            hidden, residual = intermediate
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype, attn_metadata.rope_lengths)
        # [T, 1, head_dim] each
        local_layers = self.layers[self.start_layer : self.end_layer]
        for layer, kv_cache in zip(local_layers, kv_caches, strict=True):
            hidden, residual = layer(
                hidden, residual, self.rotary_emb, cos, sin, kv_cache, attn_metadata
            )
        if not self.is_last_stage:
            assert residual is not None
            return hidden, residual
        assert self.norm is not None
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Base of the dense families; subclasses set `decoder_spec` (and the mapping)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    model_class: ClassVar[type[nn.Module]] = DecoderModel  # the layer stack
    # Checkpoint tensors we compute instead of loading (old checkpoints store inv_freq).
    ignored_weight_suffixes: ClassVar[tuple[str, ...]] = (".rotary_emb.",)
    # Mixture-of-experts families: per-expert checkpoint modules -> stacked parameters
    # (engine.loader.weight_loader), and renames applied to checkpoint names first.
    expert_weights_mapping: ClassVar[dict[str, tuple[str, int | None]] | None] = None
    weight_name_substitutions: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Whether the family's layers split over ranks (engine/distributed/sharding.py).
    supports_tensor_parallel: ClassVar[bool] = True
    supports_pipeline_parallel: ClassVar[bool] = True

    def __init__(
        self, config: Any, attn_backend: AttentionBackend, op_impl: OpImpl = "torch"
    ) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = int(config.vocab_size)
        self.head_dim = get_head_dim(config)
        self.op_impl = op_impl
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = self.model_class(config, self.decoder_spec(config), attn_backend, op_impl)
        self.tp_size = get_parallel_rank().tp_size
        self.lm_head: nn.Module | None = None
        if not self.tie_word_embeddings and self.model.is_last_stage:
            # Vocabulary-parallel like the embedding: this rank's rows of the logits.
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        attn = next(layer for layer in self.model.layers if not isinstance(layer, PPMissingLayer))
        self.num_kv_heads = attn.self_attn.num_kv_heads  # this rank's
        self._logits_plan: LinearPlan | None = None  # set by pack_weights
        self.quantized_logits: Any = None  # set by engine.layers.quantization
        self.greedy_screen: GreedyScreen | None = None  # set by pack_weights

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        raise NotImplementedError

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raises NotImplementedError for settings the family's code does not implement."""
        layer_sliding_windows(config)  # rejects unknown layer types

    @classmethod
    def kv_cache_sliding_window(cls, config: Any) -> int | None:
        """The window the KV-cache manager may free blocks behind: set only when every
        layer uses the same one (a full-attention layer needs every block)."""
        windows = set(layer_sliding_windows(config))
        return windows.pop() if len(windows) == 1 else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per local layer [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # from the previous stage
    ) -> torch.Tensor | IntermediateTensors:  # [T, hidden_size], or for the next stage
        if intermediate is None:  # the common case keeps the call as it always was
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """What each layer's cache holds per token (the runner allocates from it)."""
        return PagedKVSpec(self.num_kv_heads, self.head_dim)

    @property
    def num_local_layers(self) -> int:
        """Layers this pipeline stage computes: one KV cache each."""
        return self.model.end_layer - self.model.start_layer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        """fp32 logits; under tensor parallelism each rank projects onto its vocabulary
        rows and the rows are gathered on TP rank 0 (the other ranks get an empty
        [N, 0] tensor: they do not sample)."""
        if self.quantized_logits is not None:  # LM head kept quantized (models/quantization.py)
            return self.quantized_logits.apply(hidden, None)
        if self._logits_plan is not None and hidden.dim() == 2 and hidden.shape[0] > 0:
            logits = self._logits_plan(hidden, self._logits_weight, None).float()  # bf16 too
        else:
            logits = linear(hidden, self._logits_weight, None, None).float()
        if self.tp_size == 1:
            return logits
        gathered = tp_gather_last_dim(logits)  # [N, padded vocab] on TP rank 0
        if gathered is None:
            return logits.new_empty(logits.shape[0], 0)
        return gathered[:, : self.vocab_size]

    @property
    def _logits_weight(self) -> torch.Tensor:  # [vocab_size, hidden_size]
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self) -> int:
        """Gives every fp32 CPU projection, and the LM head (or tied embedding, a table
        rather than a `Linear`), its measured GEMM method per row bucket (see
        `engine.layers.linear_select`); call after loading. Returns how many matrices got
        one (0 where not applicable; int8 models still plan their fp32 LM head)."""
        num_planned = pack_linear_weights(self)
        self.greedy_screen = self._build_greedy_screen()
        if self.quantized_logits is not None or not self.model.is_last_stage:
            return num_planned
        weight = self._logits_weight
        if can_pack(weight):
            # The LM head is the largest GEMM of a decode step: on a 2-core Zen 4 at 64 rows
            # oneDNN took 19 ms where MKL's packed GEMM took 39.
            methods = select_methods([weight])[tuple(weight.shape)]
            self._logits_plan = make_plan(weight, methods)
            num_planned += 1
        return num_planned

    def greedy_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N] int64, the argmax of `compute_logits(hidden)` (ties to the
        lowest id) through the greedy screen (engine/layers/greedy_screen.py); None where
        the model has none, and the caller computes the logits."""
        if self.greedy_screen is None or hidden.dtype != torch.float32:
            return None
        return self.greedy_screen.argmax(hidden)

    def _build_greedy_screen(self) -> GreedyScreen | None:
        """The screen where its argmax is that of `compute_logits`: the plain projection
        (a family that transforms the logits overrides compute_logits), one TP rank, the
        last pipeline stage, an fp32 or CPU-quantized LM head, native kernels."""
        if (
            type(self).compute_logits is not DecoderForCausalLM.compute_logits
            or self.tp_size != 1
            or not self.model.is_last_stage
            or not native_kernels_available()
        ):
            return None
        quantized = self.quantized_logits
        if quantized is not None:
            if len(quantized.parts) != 1:
                return None
            return GreedyScreen.build(quantized.parts[0], self.compute_logits)
        weight = self._logits_weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        return GreedyScreen.build(fp32_weight(weight), self.compute_logits)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        on_loaded: Callable[[str], None] | None = None,
    ) -> None:
        """Hugging Face-named tensors into the (fused) parameters (`weight_loader`);
        `on_loaded(name)` runs as each parameter is complete."""
        ignored = self.ignored_weight_suffixes
        if self.lm_head is None:
            ignored = (*ignored, "lm_head.weight")  # some tied checkpoints keep a copy
        load_weights(
            self,
            weights,
            self.packed_modules_mapping,
            ignored,
            self.expert_weights_mapping,
            self.weight_name_substitutions,
            self.weights_on_other_stages(),
            on_loaded,
        )
        post_load(self)

    def weights_on_other_stages(self) -> tuple[str, ...]:
        """Checkpoint name prefixes that another pipeline stage loads."""
        decoder = self.model
        prefixes = [
            f"model.layers.{i}."
            for i, layer in enumerate(decoder.layers)
            if isinstance(layer, PPMissingLayer)
        ]
        if decoder.embed_tokens is None:
            prefixes.append("model.embed_tokens.")
        if not decoder.is_last_stage:
            prefixes += ["model.norm.", "lm_head."]
        return tuple(prefixes)

    def decode_layer_weights(self) -> list[dict[str, Any]] | None:
        """Each layer's tensors by role, and its projection `Linear`s (which may hold
        quantized weights), for a whole-step decode outside the modules (the `cpu`
        backend's, engine/attention/cpu_decode_step.py); None where a layer does more
        than that path computes (per-head q/k norms)."""
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or attn.sinks is not None or not isinstance(mlp, GatedMLP):
                return None  # q/k norms, sinks or experts: not what the whole-step path computes
            layers.append(
                {
                    "input_norm": layer.input_layernorm.weight,
                    "qkv_weight": attn.qkv_proj.weight,
                    "qkv_bias": attn.qkv_proj.bias,
                    "o_weight": attn.o_proj.weight,
                    "o_bias": attn.o_proj.bias,
                    "post_norm": layer.post_attention_layernorm.weight,
                    "gate_up_weight": mlp.gate_up_proj.weight,
                    "gate_up_bias": mlp.gate_up_proj.bias,
                    "down_weight": mlp.down_proj.weight,
                    "down_bias": mlp.down_proj.bias,
                    "qkv": attn.qkv_proj,
                    "o": attn.o_proj,
                    "gate_up": mlp.gate_up_proj,
                    "down": mlp.down_proj,
                }
            )
        return layers
