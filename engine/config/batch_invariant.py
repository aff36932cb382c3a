"""Which engines can run batch-invariant (`EngineArgs.batch_invariant`, docs/determinism.md).

With the mode on, every reduction computes a row the same way whatever the batch size,
the chunking or the row's place in the batch, so a request's tokens and logprobs do not
depend on what else the engine is serving. It is built for the CPU in float32 (the
native kernels: engine/attention/cpu_invariant_backend.py, engine/layers/batch_invariant/)
and for the GPU's `triton` backend in float32, float16 or bfloat16 (Triton kernels with
fixed tiles: engine/attention/triton_invariant_backend.py, kernels/batch_invariant_*.py);
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
    if device.startswith("cuda"):
        # the Triton path: invariant matmul and attention (kernels/batch_invariant_*.py)
        if attention_backend not in (None, "triton"):
            problems.append(
                f"attention_backend {attention_backend!r} on a GPU: only 'triton' (its "
                "batch-invariant kernels)"
            )
    elif device == "cpu":
        # the native kernels; or the Triton ones in the interpreter (TRITON_INTERPRET=1:
        # how the tests run the GPU's path on a CPU), which mis-round 16-bit dtypes
        if dtype != "float32":
            problems.append(f"dtype {dtype!r}: the CPU batch-invariant kernels compute in float32")
        if attention_backend not in (None, "cpu", "triton"):
            problems.append(
                f"attention_backend {attention_backend!r}: only the native 'cpu' one (or "
                "'triton' in Triton's interpreter)"
            )
    else:
        problems.append(f"device {device!r}: the batch-invariant kernels run on cpu and cuda")
    if world_size > 1:
        problems.append("tensor/pipeline parallelism (the all-reduce sums ranks in any order)")
    if speculative:
        problems.append("speculative decoding")
    if lora:
        problems.append("LoRA (its adapters' matmuls are torch's, batch-variant)")
    if problems:
        raise ValueError("batch_invariant=True does not support " + "; ".join(problems) + ".")
