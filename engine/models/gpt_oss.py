"""GPT-OSS (`GptOssForCausalLM`): the shared decoder with GPT-OSS's differences:

- attention sinks: a learned logit per query head joins each softmax's denominator
  (`self_attn.sinks`; every attention backend takes them, engine/attention/backend.py);
- layers alternating sliding-window and full attention (`layer_types`);
- biases on q, k, v and o;
- a mixture of experts with a biased router (top-k, then softmax over the k), biased experts
  and a clamped SwiGLU (engine/layers/gpt_oss_moe.py);
- YaRN rope (`rope_parameters`, engine/config/rope.py).

Weights: safetensors in bf16/fp32 with transformers' names, or the Hub's MXFP4 expert
blocks, dequantized at load (engine/loader/gpt_oss_weights.py). Other quantization methods
in the config are refused; so is a GGUF file (engine/loader/gguf_conversion.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from engine.layers.decoder_layers import DecoderSpec
from engine.layers.gpt_oss_moe import GptOssMoESpec
from engine.loader.gpt_oss_weights import gpt_oss_weights
from engine.models.decoder import DecoderForCausalLM

# quantization_config methods whose weights we can read (dequantized at load).
SUPPORTED_QUANTIZATION = ("mxfp4",)


class GptOssForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # experts (and sinks) are not split over ranks (yet)
    supports_pipeline_parallel = False  # not tested with the family yet

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", True))
        moe = GptOssMoESpec(
            num_experts=int(config.num_local_experts),
            top_k=int(config.num_experts_per_tok),
            intermediate_size=int(config.intermediate_size),
            renormalize=False,  # the softmax runs over the top-k logits: no renormalisation
            alpha=float(config.swiglu_alpha),
            limit=float(config.swiglu_limit),
        )
        return DecoderSpec(qkv_bias=bias, o_bias=bias, moe=moe, attention_sinks=True)

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        quantization = getattr(config, "quantization_config", None)
        if quantization is None:
            return
        method = (
            quantization.get("quant_method")
            if isinstance(quantization, dict)
            else getattr(quantization, "quant_method", None)
        )
        method = getattr(method, "value", method)  # transformers' enum
        if method not in SUPPORTED_QUANTIZATION:
            raise NotImplementedError(
                f"GPT-OSS with quantization_config quant_method={method!r} is not supported: "
                f"only {', '.join(SUPPORTED_QUANTIZATION)} expert weights (dequantized at "
                "load) or unquantized bf16/fp32 checkpoints."
            )

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        on_loaded: Callable[[str], None] | None = None,
    ) -> None:
        dtype = next(self.parameters()).dtype
        super().load_weights(gpt_oss_weights(weights, dtype), on_loaded)
