"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; also the architecture of Kimi K2 and other
DeepSeek-V3-shaped models): multi-head latent attention in every layer
(engine/layers/mla.py, a latent KV cache: engine/attention/kv_cache_spec.py), a dense gated
MLP in the first `first_k_dense_replace` layers and DeepSeek's mixture of experts in the
rest (engine/layers/deepseek_moe.py: shared plus routed experts, sigmoid scores with a
correction bias, group-limited top-k, `routed_scaling_factor`). Rope (yarn as configured)
acts on the qk_rope_head_dim dims only; the model's rotary is built for them (transformers'
config sets head_dim = qk_rope_head_dim).

Weights load from safetensors under the Hub's names (per-expert ``mlp.experts.{e}.*`` or
transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj``). The multi-token
prediction layers some checkpoints carry (``model.layers.{num_hidden_layers}.*`` and on,
`num_nextn_predict_layers`) are not used and skipped. DeepSeek's own release is block-scaled
FP8 (every projection, MLA's and the experts', with a ``weight_scale_inv``): on CUDA it
stays FP8, routed experts included (engine/layers/fp8_moe.py); elsewhere it loads
dequantized to the model's dtype as the checkpoint streams in (engine/loader/fp8_weights.py).
Refused, with the reason: other quantized checkpoints (per-channel FP8, INT4: not tested
with MLA), tensor and pipeline parallelism, and (elsewhere) llama.cpp's ``deepseek2`` GGUF
files.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.attention.kv_cache_spec import KVCacheSpec, LatentKVSpec
from engine.config.weights.checkpoint_quantization import parse_quantization_config
from engine.layers.decoder_layers import DecoderSpec
from engine.layers.deepseek_moe import DeepseekMoESpec, GroupedTopK
from engine.models.decoder import DecoderForCausalLM
from engine.models.mixtral import STACKED_EXPERT_NAMES


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        "gate_up_proj": ("gate_proj", "up_proj"),  # dense layers and shared experts
    }
    expert_weights_mapping: ClassVar[dict[str, tuple[str, int | None]] | None] = {
        "gate_proj": ("w13_weight", 0),
        "up_proj": ("w13_weight", 1),
        "down_proj": ("w2_weight", None),
    }
    weight_name_substitutions: ClassVar[tuple[tuple[str, str], ...]] = STACKED_EXPERT_NAMES
    supports_tensor_parallel = False  # heads and experts are not split over ranks (yet)
    supports_pipeline_parallel = False  # untested: the latent cache has not run over stages

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        """The shared `DecoderLayer` with MLA, DeepSeek's experts past the first
        `first_k_dense_replace` layers, and there a gated MLP without biases."""
        moe = None
        if int(config.first_k_dense_replace or 0) < config.num_hidden_layers:
            moe = DeepseekMoESpec.from_config(config)
        return DecoderSpec(mla=True, moe=moe)

    @classmethod
    def check_config(cls, config: Any) -> None:
        _check_quantization(getattr(config, "quantization_config", None))
        first_dense = int(config.first_k_dense_replace or 0)
        if first_dense < config.num_hidden_layers:
            GroupedTopK.from_config(config)  # the routing settings, checked before building
        super().check_config(config)

    @classmethod
    def kv_cache_sliding_window(cls, config: Any) -> int | None:
        return None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        config = self.config
        return LatentKVSpec(int(config.kv_lora_rank), int(config.qk_rope_head_dim))

    def weights_on_other_stages(self) -> tuple[str, ...]:
        """The multi-token prediction layers past the model's are never loaded."""
        num_layers = int(self.config.num_hidden_layers)
        num_mtp = int(getattr(self.config, "num_nextn_predict_layers", None) or 0)
        mtp = tuple(f"model.layers.{i}." for i in range(num_layers, num_layers + num_mtp))
        return super().weights_on_other_stages() + mtp

    def decode_layer_weights(self) -> list[dict[str, Any]] | None:
        return None  # MLA layers: not what the fused CPU decode step computes


def _check_quantization(quant: Any) -> None:
    """Block-scaled FP8 (DeepSeek's release, or llm-compressor's FP8_BLOCK) is dequantized at
    load; any other quantized checkpoint is refused with what to do."""
    if not quant:
        return
    if not isinstance(quant, dict):
        quant = quant.to_dict()  # transformers' config object
    found = parse_quantization_config(dict(quant))  # ValueError naming an unserved field
    strategy = getattr(found.scheme, "weight_strategy", None)
    if found.method != "fp8" or strategy != "block":
        scheme = found.method + (f" per {strategy}" if strategy else "")
        raise NotImplementedError(
            f"DeepseekV3ForCausalLM: the checkpoint is quantized (quant_method="
            f"{found.quant_method!r}: {scheme}); of quantized "
            "checkpoints only block-scaled FP8 (the release's format, the one tested with "
            "MLA) loads. Dequantize it to bf16 first."
        )
