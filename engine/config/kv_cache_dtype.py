"""The KV cache's element type: `EngineArgs.kv_cache_dtype` resolved once into
`CacheConfig.cache_dtype` (a torch dtype name, never "auto" in an engine's config).

"auto" is the model dtype (vLLM's meaning), with one exception: a model whose GGUF blocks stay
quantized on the CPU gets a float16 cache, as llama.cpp (and so Ollama) gives the same file by
default, and as vLLM would too (it runs a GGUF model in a 16-bit dtype). The fp32 activations
of that path would otherwise double the cache: for the default model 45 KiB instead of 22.5 KiB
per token, most of an offline run's resident memory. The K/V rows are rounded to fp16 (11
significant bits) when written and widened when read, in hardware on every x86-64-v3 CPU (F16C);
GGUF checkpoints' K/V fit fp16's range for the same reason llama.cpp can run them.
`kv_cache_dtype="float32"` keeps the full-width cache for such a model.

"fp8" / "fp8_e4m3" (vLLM's names) is an E4M3 cache with per-tensor k/v scales per layer (the
checkpoint's `k_scale` / `v_scale`, else 1.0): 1 byte an element, so twice the blocks of a
16-bit cache. Only the Triton kernels read and write one (`check_fp8_kv_cache`).
"""

from __future__ import annotations

# kv_cache_dtype values besides "auto" (vLLM's names) and aliases -> the torch dtype name.
_KV_CACHE_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",  # only as wide as an fp32 model (never wider than the model dtype)
    "fp32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
}
FP8_CACHE_DTYPE_NAME = "float8_e4m3fn"
CACHE_DTYPE_NAMES = ("float32", "bfloat16", "float16", FP8_CACHE_DTYPE_NAME)  # resolved


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: str, *, gguf_blocks_on_cpu: bool = False
) -> str:
    """The KV cache's torch dtype name for `kv_cache_dtype` ("auto": the model's, float16 for
    GGUF blocks kept quantized on the CPU)."""
    if not isinstance(kv_cache_dtype, str):
        raise ValueError(f"kv_cache_dtype must be a string, got {kv_cache_dtype!r}.")
    if kv_cache_dtype == "auto":
        return "float16" if gguf_blocks_on_cpu and model_dtype == "float32" else model_dtype
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {sorted(_KV_CACHE_DTYPES)}, "
            f"got {kv_cache_dtype!r}."
        )
    resolved = _KV_CACHE_DTYPES[kv_cache_dtype]
    if resolved == "float32" and model_dtype != "float32":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is wider than the model dtype {model_dtype}; "
            "use 'auto' (the model's), 'bfloat16' or 'float16'."
        )
    return resolved


def check_fp8_kv_cache(
    cache_dtype: str, *, device: str, attention_backend: str | None, batch_invariant: bool
) -> None:
    """ValueError unless an FP8 cache (`cache_dtype` resolved) has the Triton kernels: the
    triton attention backend (the default on CUDA; on the CPU only when named, in Triton's
    interpreter), without batch_invariant (its attention takes no FP8 cache)."""
    if cache_dtype != FP8_CACHE_DTYPE_NAME:
        return
    backend = attention_backend or ("triton" if device.startswith("cuda") else "cpu")
    if backend != "triton":
        raise ValueError(
            f"kv_cache_dtype='fp8' needs attention_backend='triton' (the FP8 cache is written "
            f"and read by the Triton kernels); the {backend!r} backend takes a 16-bit or "
            "model-dtype cache."
        )
    if batch_invariant:
        raise ValueError(
            "kv_cache_dtype='fp8' is not served with batch_invariant=True: the batch-invariant "
            "attention reads a 16-bit or model-dtype cache."
        )
