"""The device and compute dtype of an engine: `EngineArgs.device` and `EngineArgs.dtype`
resolved once, by `EngineArgs.create_engine_config` (engine_config.py)."""

from __future__ import annotations

from typing import Any

from engine.config.cpu_dtype import cpu_auto_dtype, cpu_flags


def resolve_device(device: str) -> str:
    """`EngineArgs.device`: "auto" is CUDA where it is available, else the CPU."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available.")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}.")
    return device


def resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    """`EngineArgs.dtype` as a torch dtype name. "auto": on the CPU what it computes natively
    (cpu_dtype.py), on CUDA the checkpoint's 16-bit dtype (bf16 when it is fp32 or unset)."""
    allowed = {"auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"}
    if dtype not in allowed:
        raise ValueError(f"dtype must be one of {sorted(allowed)}, got {dtype!r}.")
    aliases = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32"}
    aliases["bf16"] = "bfloat16"
    if dtype != "auto":
        return aliases.get(dtype, dtype)
    if device == "cpu":
        # bf16 where the CPU computes it natively (AMX-BF16, AVX512-BF16), else fp32.
        return cpu_auto_dtype(cpu_flags())
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(ckpt).replace("torch.", "") if ckpt is not None else "bfloat16"
    return name if name in ("bfloat16", "float16") else "bfloat16"
