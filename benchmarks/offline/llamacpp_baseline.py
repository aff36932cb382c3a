"""llama.cpp (through `llama-cpp-python`, not a project dependency) as a baseline on the same
GGUF file, for benchmarks/offline/throughput.py `--llamacpp-baseline`.

Same prompts (token ids, fed as ids: no tokenizer round trip), same number of new tokens
(greedy, never stopping at EOS), `threads` threads for both prompt processing and decoding.
The high-level `Llama` object runs one sequence at a time, so the offline workload runs
its prompts one after the other ("sequential"): llama.cpp's multi-sequence batching is only
reachable through its low-level batch API, which this baseline does not drive.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def llamacpp_missing() -> str | None:
    """Why the baseline cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return (
            f"--llamacpp-baseline needs llama-cpp-python ({error}); install it with "
            "`pip install llama-cpp-python` (it builds llama.cpp from source with cmake)."
        )
    return None


def gguf_path(model: str | None) -> Path:
    """The GGUF file the engine reads: the default model's, or `model` when it is one."""
    from engine.api.model_files import default_model_path

    path = default_model_path() if model is None else Path(model).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ValueError(f"--llamacpp-baseline needs a .gguf model, got --model {model}.")
    return path


def load_llamacpp(path: Path, context_len: int, threads: int, seed: int) -> Any:
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_ctx=context_len,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=seed,
        verbose=False,
    )


def generate_ids(llm: Any, prompt: list[int], output_len: int) -> list[int]:
    """Greedy decode of exactly `output_len` tokens after `prompt` (cache reset first)."""
    tokens: list[int] = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
        tokens.append(token)
        if len(tokens) == output_len:
            break
    return tokens


def run_llamacpp(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    """Seconds for every prompt, one after the other."""
    start = time.perf_counter()
    for prompt in prompts:
        assert len(generate_ids(llm, prompt, output_len)) == output_len
    return time.perf_counter() - start
