"""Which engines can run batch-invariant (`EngineArgs.batch_invariant`, docs/determinism.md).

With the mode on, every reduction computes a row the same way whatever the batch size,
the chunking or the row's place in the batch, so a request's tokens and logprobs do not
depend on what else the engine is serving. It is built for the CPU in float32 (the
native kernels: engine/attention/cpu_invariant_backend.py, engine/layers/batch_invariant/);
combinations that would bring back a batch-dependent reduction are refused here, once,
when the config is made, rather than silently run variant.
"""

from __future__ import annotations


def check_batch_invariant(
    *,
    device: str,
    dtype: str,
    attention_backend: str | None,
    world_size: int,
    speculative: bool,
    lora: bool,
) -> None:
    """ValueError naming the setting that batch-invariant inference cannot honour."""
    problems = []
    if device != "cpu":
        problems.append(
            f"device {device!r}: the batch-invariant kernels are CPU-only so far (the GPU "
            "path, fixed-split Triton kernels and matmuls, is not built yet)"
        )
    if dtype != "float32":
        problems.append(f"dtype {dtype!r}: the CPU batch-invariant kernels compute in float32")
    if attention_backend not in (None, "cpu"):
        problems.append(f"attention_backend {attention_backend!r}: only the native 'cpu' one")
    if world_size > 1:
        problems.append("tensor/pipeline parallelism (the all-reduce sums ranks in any order)")
    if speculative:
        problems.append("speculative decoding")
    if lora:
        problems.append("LoRA (its adapters' matmuls are torch's, batch-variant)")
    if problems:
        raise ValueError("batch_invariant=True does not support " + "; ".join(problems) + ".")
