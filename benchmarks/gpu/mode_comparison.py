"""What the GPU benchmarks that compare an engine mode off and on share (async scheduling:
benchmarks/gpu/async_scheduling_decode.py; batch-invariant inference:
benchmarks/gpu/batch_invariant_decode.py): their common flags, the engine over a dummy
model directory with the mode's arguments, and the device memory freed between the two.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.llama8b import SHAPES
from engine import LLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape, the device, the batches and lengths of the decode steps timed."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 200])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help="0: what is left")
    parser.add_argument("--output-json", default=None)


def start_engine(args: argparse.Namespace, model_dir: Path, **mode: Any) -> LLM:
    """The engine over `model_dir`'s config with random weights, sized for the largest
    batch; `mode`: the engine arguments that differ between the runs compared."""
    return LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=max(args.batches),
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) or None, **mode,
    )  # fmt: skip


def free_device_memory() -> None:
    """After the caller dropped its engine: its weights and cache given back, so that the
    next run's engine profiles the same free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
