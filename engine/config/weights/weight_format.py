"""The dtype and the quantization an engine's weights run in, decided together once in
`EngineArgs.create_engine_config`, since each constrains the other:

- a checkpoint stored quantized (FP8, AWQ, GPTQ: checkpoint_quantization.py) runs its own
  method whatever the device, and is refused when its config is not served;
- otherwise `EngineArgs.quantization` picks a CPU method (GGUF blocks, int8: quantization.py);
- on a bf16 CPU, `dtype="auto"` stays fp32 where weights are kept in the native quantized
  kernels or the batch-invariant kernels run, since those compute in fp32 (cpu_dtype.py);
- `load_format="dummy"` draws weights itself, so it takes unquantized (or FP8) models only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.device_dtype import resolve_dtype
from engine.config.weights.checkpoint_quantization import (
    read_checkpoint_quantization,
    resolve_checkpoint_quantization,
    stays_quantized_on_cpu,
)
from engine.config.weights.quantization import resolve_quantization


@dataclass(frozen=True, slots=True)
class WeightRequest:
    """What `EngineArgs` asked for: its `dtype`, `quantization`, `load_format` and
    `batch_invariant` fields as given."""

    dtype: str
    quantization: str | None
    load_format: str
    batch_invariant: bool


def resolve_weight_format(
    request: WeightRequest,
    model_dir: Path,
    hf_config: Any,
    gguf_file: Path | None,
    device: str,
    world_size: int,
) -> tuple[str, str | None]:
    """(dtype, quantization) the model is built in; ValueError naming the field otherwise."""
    dtype = resolve_dtype(request.dtype, hf_config, device)
    checkpoint_quant = None if gguf_file else read_checkpoint_quantization(model_dir, hf_config)
    checkpoint_method = resolve_checkpoint_quantization(
        request.quantization, checkpoint_quant, world_size
    )
    cpu_bf16 = request.dtype == "auto" and dtype == "bfloat16" and device == "cpu"
    if cpu_bf16 and checkpoint_quant is not None:
        # native Q4_0 blocks compute in fp32, as do the batch-invariant kernels
        if stays_quantized_on_cpu(checkpoint_quant) or request.batch_invariant:
            dtype = "float32"
    elif cpu_bf16:
        # GGUF blocks (and int8) kept quantized compute in fp32 (their kernels and the
        # greedy screen): where they will run, "auto" stays fp32.
        kept = resolve_quantization(request.quantization, gguf_file, device, "float32", world_size)
        if kept is not None or request.batch_invariant:
            dtype = "float32"
    quantization = checkpoint_method or resolve_quantization(
        request.quantization, gguf_file, device, dtype, world_size
    )
    if request.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {request.load_format!r}.")
    if request.load_format == "dummy" and quantization not in (None, "fp8"):
        raise ValueError(
            f"load_format='dummy' draws unquantized (or FP8) weights; "
            f"quantization={quantization!r} needs the checkpoint (pass quantization=None)."
        )
    return dtype, quantization
