"""Which weight quantization an engine runs (`EngineArgs.quantization`), decided once in
`create_engine_config`; the methods themselves are engine/layers/quantization.py."""

from __future__ import annotations

from pathlib import Path

from engine.api.model_files import default_model_path


def gguf_source(model: str | None) -> Path | None:
    """The .gguf file the model is read from (the default model is one), else None."""
    path = default_model_path() if model is None else Path(model).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def resolve_quantization(
    quantization: str | None,
    gguf_file: Path | None,
    device: str,
    dtype: str,
    world_size: int = 1,
) -> str | None:
    """ "auto" -> "gguf" where it runs (a llama GGUF on CPU, fp32, native kernels built,
    one rank), else None; an explicit method is checked and errors name what is missing."""
    allowed = ("auto", "none", "gguf", "int8")
    if quantization is not None and quantization not in allowed:
        raise ValueError(f"quantization must be one of {allowed} or None, got {quantization!r}.")
    if quantization in (None, "none"):
        return None
    if quantization == "auto":
        if gguf_file is None or device != "cpu" or dtype != "float32" or world_size > 1:
            return None
        return "gguf" if _gguf_quantization_problem(gguf_file) is None else None
    if device != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only, device is {device!r}.")
    if world_size > 1:
        # Quantized blocks are not split between ranks (yet): docs/parallelism.md.
        raise ValueError(
            f"quantization={quantization!r} needs tensor_parallel_size x "
            f"pipeline_parallel_size = 1, got {world_size}."
        )
    if dtype != "float32":
        raise ValueError(f"quantization={quantization!r} needs dtype float32, got {dtype!r}.")
    if quantization == "gguf":
        if gguf_file is None:
            raise ValueError("quantization='gguf' needs a .gguf model file.")
        problem = _gguf_quantization_problem(gguf_file)
        if problem is not None:
            raise ValueError(f"quantization='gguf': {problem}.")
    # torch-side: imported when a config is made, so importing a config stays torch-free
    # (.importlinter, contract `config`).
    from engine.native import native_kernels_available

    if not native_kernels_available():
        raise ValueError(
            f"quantization={quantization!r} needs the native CPU kernels (no C compiler?)."
        )
    return quantization


def _gguf_quantization_problem(gguf_file: Path) -> str | None:
    """Why the file's blocks cannot be kept quantized here, or None."""
    # torch-side, like the import in resolve_quantization
    from engine.loader.gguf_blocks import SUPPORTED_ARCHITECTURES, gguf_architecture
    from engine.native import native_kernels_available

    architecture = gguf_architecture(gguf_file)
    if architecture not in SUPPORTED_ARCHITECTURES:
        return f"GGUF architecture {architecture!r} is not one of {SUPPORTED_ARCHITECTURES}"
    if not native_kernels_available():
        return "the native CPU kernels are unavailable (no C compiler?)"
    return None
