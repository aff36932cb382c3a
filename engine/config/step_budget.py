"""The default token budget of a step (`max_num_batched_tokens` when it is not given).

A step's wall time is about its token count times the model's cost per token over the
device's speed, and a serving engine wants every step short: a step is the granularity at
which streams get tokens, requests are admitted and aborts take effect, and a long one
delays every stream in the batch (and, before the stall watchdog counted progress, looked
like a hang). Measured on a 2-core AMD EPYC (AVX2) with the default model (fp32, 135M
parameters): a step of 2048 prompt tokens costs ~8 CPU-seconds (~4 s of wall time, ~11 s
with the machine loaded), one of 256 decode rows ~1.4 CPU-seconds (~0.7 s). So on the CPU the
budget is the decode batch (`max_num_seqs`, 256 by default), not more than 2048: one token
for every running sequence fits, and a prompt is prefilled in chunks of that size (the same
total work, so about the same time to first token, in steps of under a second). A GPU takes
2048-token steps in milliseconds: there the budget stays 2048, as before. Without chunked
prefill a whole prompt must fit in one step, so the budget is at least `max_model_len`.

Short steps cost throughput: the same 256-request burst took 4 % longer at 256 tokens a step
than at 2048 on a quiet machine (28.2 vs 27.0 s; 55 vs 52 CPU-seconds, 66 vs 52 on a loaded
one; benchmarks/offline/step_times.py), since most steps mix decode rows with a prefill chunk
and fewer run as pure decode steps; its longest step took 0.78 s against 4.6 s. A server
takes that for streams that never wait seconds for a token; offline batch work does not: the
offline `LLM` keeps 2048 unless told otherwise (vLLM's `LLM` class, too, defaults to a larger
budget than its API server).
"""

from __future__ import annotations

GPU_DEFAULT = 2048
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048  # the offline `LLM`'s default on every device
CPU_MIN, CPU_MAX = 256, 2048


def default_max_num_batched_tokens(
    device: str, max_num_seqs: int, enable_chunked_prefill: bool, max_model_len: int
) -> int:
    if not enable_chunked_prefill:
        return max(GPU_DEFAULT, max_model_len)
    if device == "cpu":
        return min(max(max_num_seqs, CPU_MIN), CPU_MAX)
    return GPU_DEFAULT
