"""Loading model weights into our modules: safetensors tensors (read with pread, or mapped
lazily) or a GGUF file's quantized blocks, through the generic weight loader.

Which directory or file a model is, and the converted-GGUF cache: engine/api/model_files.py
(torch-free). Only safetensors are read: no pickle checkpoints, no remote code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.attention.backend import AttentionBackend
from engine.config.weights.checkpoint_quantization import read_checkpoint_quantization
from engine.config.weights.int4_checkpoint import INT4_METHODS
from engine.distributed.parallel_state import get_parallel_rank
from engine.layers.batch_invariant import make_batch_invariant
from engine.layers.crossover import plan_crossovers
from engine.layers.fp8_block_linear import (
    block_fits_kernel,
    block_fp8_gemm_kernel,
    block_fp8_w8a8_kernel,
    keeps_block_fp8,
    triton_available,
)
from engine.layers.fp8_linear import (
    FP8_COMPUTE_ENV,
    fp8_compute_forced,
    fp8_gemv_kernel,
    fp8_tensor_cores,
    token_quantizer,
)
from engine.layers.ops import OpImpl, select_op_impl
from engine.layers.parallel_layers import post_load
from engine.layers.quant_select import plan_quantized_routes
from engine.layers.quantization import check_quantizable, projection_layers, quantize_on_load
from engine.loader.block_fp8_weights import install_block_fp8_layers
from engine.loader.dummy_weights import fill_dummy_weights
from engine.loader.fp8_expert_weights import keep_fp8_experts
from engine.loader.fp8_weights import Fp8Checkpoint, install_fp8_layers
from engine.loader.gguf_weights import check_gguf_blocks, install_gguf_blocks
from engine.loader.int4_weights import Int4Loading
from engine.loader.materialize import to_empty
from engine.loader.safetensors_reader import read_safetensors
from engine.models.decoder import DecoderForCausalLM
from engine.models.registry import get_model_class

logger = logging.getLogger(__name__)


def iter_safetensors(
    model_dir: Path, skip: set[str] | frozenset[str] = frozenset(), lazy: bool = False
) -> Iterator[tuple[str, Any]]:
    """Streams (name, tensor) from every ``*.safetensors`` file of the directory; names in
    `skip` are never read. Whole tensors are read without mapping the file
    (engine/loader/safetensors_reader.py). `lazy`: (name, slice) instead, read only where
    indexed, so a tensor-parallel rank reads only its rows (engine/loader/weight_loader.py)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir} (pickle checkpoints are not supported)."
        )
    for file in files:
        if not lazy:
            yield from read_safetensors(file, skip)
            continue
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name not in skip:
                    yield name, f.get_slice(name)


def load_model(
    model_dir: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    op_impl: OpImpl | None = None,
    quantization: str | None = None,
    gguf_file: Path | None = None,
    load_format: str = "auto",
    seed: int = 0,
    keep_fp8: bool | None = None,
) -> DecoderForCausalLM:
    """Builds the registered class for the config's architecture without initialising it,
    then fills it from the directory's weights.

    `weights` replaces the directory's safetensors (tests pass a state dict this way);
    `op_impl` overrides the op implementation chosen from the backend, device and dtype.
    `quantization` keeps the projections quantized (engine/layers/quantization.py):
    "gguf" fills them from `gguf_file`'s blocks before any fp32 storage exists; "int8"
    quantizes each projection as soon as it is loaded; "awq" / "gptq" /
    "compressed-tensors" read the checkpoint's INT4 tensors (engine/loader/int4_weights.py).
    `load_format="dummy"` reads no weights: every parameter is drawn from `seed`
    (engine/loader/dummy_weights.py).
    """
    model_class = get_model_class(hf_config)
    if op_impl is None:
        op_impl = select_op_impl(attn_backend.name, device, dtype)
    with torch.device("meta"):
        model = model_class(hf_config, attn_backend, op_impl)
    model = model.to(dtype=dtype)
    kept: set[str] = set()
    if quantization == "gguf":
        kept, checks = _install_gguf(model, hf_config, device, gguf_file)
    int4 = None
    if quantization in INT4_METHODS:  # before storage: kept INT4 layers get none
        int4 = Int4Loading(model, _int4_scheme(model_dir, hf_config), model_dir, device)
    fp8 = None
    if quantization == "fp8":
        fp8 = _fp8_checkpoint(model, model_dir, hf_config, dtype, device, keep_fp8)
    model = to_empty(model, device)  # as model.to_empty, without importing sympy
    if load_format == "dummy":  # EngineArgs allows it only without quantization
        fill_dummy_weights(model, seed)
        post_load(model)
        logger.info("Drew random weights (load_format='dummy', seed %d).", seed)
    else:
        if weights is None:
            several = get_parallel_rank().world_size > 1  # a rank reads only its slices
            weights = iter_safetensors(model_dir, skip=kept, lazy=several)
        if int4 is not None:
            weights = int4.wrap(weights)
        if fp8 is not None:
            weights = fp8.weights(weights)
        _load_checkpoint(model, weights, kept, quantization)
        if fp8 is not None:
            _set_kv_scales(model, fp8.kv_scales)
        if int4 is not None:
            int4.finish()
    if quantization == "gguf":
        check_gguf_blocks(model_dir, checks)
        logger.info("Kept %d GGUF tensors quantized, read from %s.", len(kept), gguf_file)
    elif quantization not in (None, "fp8", *INT4_METHODS):  # fp8, INT4: said by their loaders
        num_quantized = sum(m.quant_method is not None for _, m in projection_layers(model))
        logger.info("Kept %d weight matrices quantized (%s).", num_quantized, quantization)
    if device.type == "cpu":
        num_planned = model.pack_weights()  # fp32 weights only: quantized layers have none
        if num_planned:
            logger.info("Chose the fp32 GEMM method of %d weight matrices.", num_planned)
        if quantization is not None and (int4 is None or int4.native):
            num_int8 = plan_quantized_routes(model)
            if num_int8:
                logger.info("%d quantized weights take the int8 route on batched steps.", num_int8)
    # Two-route layers (FP8, INT4 on CUDA): their kernel/GEMM crossover, timed before any
    # CUDA graph is captured (a no-op on the CPU: engine/layers/crossover.py).
    plan_crossovers(model, dtype, device)
    if attn_backend.batch_invariant:  # EngineArgs batch_invariant: one kernel for every route
        num_invariant = make_batch_invariant(model, attn_backend.name)
        logger.info("Put %d weight matrices on the batch-invariant kernel.", num_invariant)
    return model.eval()


def _load_checkpoint(
    model: DecoderForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    kept: set[str],
    quantization: str | None,
) -> None:
    on_loaded = None
    if quantization == "int8":
        on_loaded = quantize_on_load(model, quantization)
    model.load_weights(((name, tensor) for name, tensor in weights if name not in kept), on_loaded)


def _int4_scheme(model_dir: Path, hf_config: Any) -> Any:
    found = read_checkpoint_quantization(model_dir, hf_config)
    if found is None or found.method not in INT4_METHODS:
        raise ValueError(
            f"an INT4 method needs an AWQ, GPTQ or compressed-tensors INT4 checkpoint; "
            f"{model_dir} is not one."
        )
    return found.scheme


def _fp8_checkpoint(
    model: DecoderForCausalLM,
    model_dir: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    keep_fp8: bool | None,
) -> Fp8Checkpoint:
    found = read_checkpoint_quantization(model_dir, hf_config)
    if found is None or found.method != "fp8":
        raise ValueError(f"quantization='fp8' needs an FP8 checkpoint; {model_dir} is not one.")
    skipped = model.weights_on_other_stages()
    if found.scheme.weight_strategy == "block":
        return _block_fp8_checkpoint(model, found, dtype, device, keep_fp8, skipped)
    # MoE models pass: their experts stay FP8 where Triton runs (W8A16, any CUDA GPU), else
    # they are dequantized to the checkpoint's own values, as the dense projections are.
    if keep_fp8 is None:
        keep_fp8 = fp8_compute_forced()
    experts = keep_fp8_experts(model, found.scheme, device, keep_fp8)
    if keep_fp8 is None:
        keep_fp8 = fp8_tensor_cores(device)
    kept: frozenset[str] = frozenset()
    if keep_fp8:
        triton = device.type == "cuda"
        kept = install_fp8_layers(
            model,
            found.scheme,
            model.packed_modules_mapping,
            quantize=token_quantizer(triton),
            gemv=fp8_gemv_kernel(triton),
        )
        logger.info(
            "FP8 checkpoint (%s): %d projections run in FP8%s%s.",
            found.quant_method, len(kept), experts.said(), _why(experts.dequantized),
        )  # fmt: skip
    else:
        logger.info(
            "FP8 checkpoint (%s): %s has no FP8 tensor cores, so the weights are dequantized "
            "to %s at load%s%s.", found.quant_method, device, dtype,
            f" except the experts of {experts.num_layers} MoE layers (kept in FP8: the Triton "
            "grouped GEMM needs no FP8 tensor cores)" if experts.num_layers else "",
            _why(experts.dequantized),
        )  # fmt: skip
    return Fp8Checkpoint(found.scheme, dtype, kept | experts.modules, skipped=skipped)


def _why(dequantized: list[str]) -> str:
    """ " (<layer>: <why>; ...)" for the layers left dequantized, at most three named."""
    if not dequantized:
        return ""
    return f" ({'; '.join(dequantized[:3])}{', ...' if len(dequantized) > 3 else ''})"


def _block_fp8_checkpoint(
    model: DecoderForCausalLM,
    found: Any,
    dtype: torch.dtype,
    device: torch.device,
    keep_fp8: bool | None,
    skipped: tuple,
) -> Fp8Checkpoint:
    """Block-scaled FP8 stays FP8 where Triton runs the block GEMM (kernels/fp8_block_gemm.py,
    W8A16: the weight dequantized in registers, so no FP8 tensor cores are needed): a CUDA
    device with Triton installed, or any device with $PAGEDSERVE_FP8_COMPUTE=fp8 (the CPU
    then runs it in Triton's interpreter: how the tests force this path). With FP8 tensor
    cores prefill rows take the W8A8 GEMM (kernels/fp8_block_w8a8.py; the crossover
    measured at load: engine/layers/fp8_block_linear.py). Elsewhere, and
    for the layers that cannot keep it (engine/loader/block_fp8_weights.py: ragged fused
    shards, tensor-parallel slices; MoE layers whose gate | up rows are not whole blocks:
    engine/loader/fp8_expert_weights.py), the weights are dequantized at load."""
    block = list(found.scheme.block_size)
    if keep_fp8 is None:
        keep_fp8 = keeps_block_fp8(device, fp8_compute_forced())
    if not keep_fp8:
        logger.info(
            "Block-scaled FP8 checkpoint (%s, blocks %s): the weights are dequantized to %s at "
            "load on %s (the block-scaled FP8 GEMM runs on CUDA, through Triton).",
            found.quant_method, block, dtype, device,
        )  # fmt: skip
        return Fp8Checkpoint(found.scheme, dtype, skipped=skipped)
    if not triton_available():
        raise ValueError(
            f"${FP8_COMPUTE_ENV}=fp8: block-scaled FP8 runs through a Triton kernel, and "
            "Triton is not installed (unset it, or 'dequantize')."
        )
    prefill_gemm = block_fp8_w8a8_kernel(device, found.scheme.block_size)
    kept, dequantized = install_block_fp8_layers(
        model,
        found.scheme,
        model.packed_modules_mapping,
        block_fp8_gemm_kernel(),
        kernel_takes_block=block_fits_kernel(found.scheme.block_size),
        prefill_gemm=prefill_gemm,
    )
    experts = keep_fp8_experts(model, found.scheme, device, True)
    dequantized += experts.dequantized
    routes = "W8A16, and W8A8 on FP8 tensor cores for prefill" if prefill_gemm else "W8A16"
    logger.info(
        "Block-scaled FP8 checkpoint (%s, blocks %s): %d projections run in FP8 (the Triton "
        "block GEMM: %s)%s; %d dequantized to %s at load%s.",
        found.quant_method, block, len(kept), routes, experts.said(), len(dequantized), dtype,
        _why(dequantized),
    )  # fmt: skip
    return Fp8Checkpoint(found.scheme, dtype, kept | experts.modules, skipped=skipped)


def _set_kv_scales(model: DecoderForCausalLM, kv_scales: dict[str, dict[str, float]]) -> None:
    """The checkpoint's per-tensor KV-cache scales onto its attention layers (`k_scale` /
    `v_scale`, read by an FP8 KV cache's kernels; 1.0 where the checkpoint has none)."""
    for name, scales in kv_scales.items():
        try:
            attn = model.get_submodule(name)
        except AttributeError:
            attn = None
        if attn is None or not hasattr(attn, "k_scale"):
            raise ValueError(f"checkpoint KV-cache scales for {name!r}: not an attention layer.")
        for key, value in scales.items():
            setattr(attn, key, value)


def _install_gguf(
    model: DecoderForCausalLM, hf_config: Any, device: torch.device, gguf_file: Path | None
) -> tuple[set[str], list[Any]]:
    if gguf_file is None:
        raise ValueError("quantization='gguf' needs the model's .gguf file.")
    check_quantizable(model, "gguf")
    return install_gguf_blocks(model, gguf_file, hf_config, device)
