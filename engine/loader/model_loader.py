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
from engine.distributed.parallel_state import get_parallel_rank
from engine.layers.batch_invariant import make_batch_invariant
from engine.layers.ops import OpImpl, select_op_impl
from engine.layers.parallel_layers import post_load
from engine.layers.quant_select import plan_quantized_routes
from engine.layers.quantization import check_quantizable, projection_layers, quantize_on_load
from engine.loader.dummy_weights import fill_dummy_weights
from engine.loader.gguf_weights import check_gguf_blocks, install_gguf_blocks
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
) -> DecoderForCausalLM:
    """Builds the registered class for the config's architecture without initialising it,
    then fills it from the directory's weights.

    `weights` replaces the directory's safetensors (tests pass a state dict this way);
    `op_impl` overrides the op implementation chosen from the backend, device and dtype.
    `quantization` keeps the projections quantized (engine/layers/quantization.py):
    "gguf" fills them from `gguf_file`'s blocks before any fp32 storage exists; "int8"
    quantizes each projection as soon as it is loaded. `load_format="dummy"` reads no
    weights: every parameter is drawn from `seed` (engine/loader/dummy_weights.py).
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
    model = model.to_empty(device=device)
    if load_format == "dummy":  # EngineArgs allows it only without quantization
        fill_dummy_weights(model, seed)
        post_load(model)
        logger.info("Drew random weights (load_format='dummy', seed %d).", seed)
    else:
        if weights is None:
            several = get_parallel_rank().world_size > 1  # a rank reads only its slices
            weights = iter_safetensors(model_dir, skip=kept, lazy=several)
        _load_checkpoint(model, weights, kept, quantization)
    if quantization == "gguf":
        check_gguf_blocks(model_dir, checks)
        logger.info("Kept %d GGUF tensors quantized, read from %s.", len(kept), gguf_file)
    elif quantization is not None:
        num_quantized = sum(m.quant_method is not None for _, m in projection_layers(model))
        logger.info("Kept %d weight matrices quantized (%s).", num_quantized, quantization)
    if device.type == "cpu":
        num_planned = model.pack_weights()  # fp32 weights only: quantized layers have none
        if num_planned:
            logger.info("Chose the fp32 GEMM method of %d weight matrices.", num_planned)
        if quantization is not None:
            num_int8 = plan_quantized_routes(model)
            if num_int8:
                logger.info("%d quantized weights take the int8 route on batched steps.", num_int8)
    if attn_backend.batch_invariant:  # EngineArgs batch_invariant: one kernel for every route
        num_invariant = make_batch_invariant(model)
        logger.info("Put %d weight matrices on the batch-invariant kernel.", num_invariant)
    return model.eval()


def _load_checkpoint(
    model: DecoderForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    kept: set[str],
    quantization: str | None,
) -> None:
    on_loaded = None
    if quantization is not None and quantization != "gguf":
        on_loaded = quantize_on_load(model, quantization)
    model.load_weights(((name, tensor) for name, tensor in weights if name not in kept), on_loaded)


def _install_gguf(
    model: DecoderForCausalLM, hf_config: Any, device: torch.device, gguf_file: Path | None
) -> tuple[set[str], list[Any]]:
    if gguf_file is None:
        raise ValueError("quantization='gguf' needs the model's .gguf file.")
    check_quantizable(model, "gguf")
    return install_gguf_blocks(model, gguf_file, hf_config, device)
