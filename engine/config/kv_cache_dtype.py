"""The KV cache's element type: `EngineArgs.kv_cache_dtype` resolved once into
`CacheConfig.cache_dtype` (a torch dtype name, never "auto" in an engine's config)."""

from __future__ import annotations

# kv_cache_dtype values besides "auto" (vLLM's names) and aliases -> the torch dtype name.
# Never wider than the model dtype: "auto" is the model's own.
_KV_CACHE_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
CACHE_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # CacheConfig.cache_dtype, resolved


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV cache's torch dtype name for `kv_cache_dtype` ("auto": the model's)."""
    if not isinstance(kv_cache_dtype, str):
        raise ValueError(f"kv_cache_dtype must be a string, got {kv_cache_dtype!r}.")
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype.startswith("fp8"):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: fp8 KV caches are not supported; "
            "use 'auto', 'bfloat16' or 'float16'."
        )
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {sorted(_KV_CACHE_DTYPES)}, "
            f"got {kv_cache_dtype!r}."
        )
    return _KV_CACHE_DTYPES[kv_cache_dtype]
