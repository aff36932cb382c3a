"""One pipeline stage's share of a forward pass.

Every rank of a step knows the step's token count (the step description is broadcast), so
what a stage receives needs no header: ``[2, num_tokens, hidden_size]`` in the model dtype,
the hidden states and the residual stream stacked::

    stage 0: embed, layers [0, L/2)        --send (hidden, residual)-->
    stage 1: layers [L/2, L), norm, logits

Each stage computes its batches in the order the driver sent them, so with as many
batches in flight as stages, stage 0 computes batch k + 1 while stage 1 computes batch k.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.distributed.communication import recv_from_prev_stage, send_to_next_stage
from engine.distributed.parallel_state import get_parallel_rank


def stage_forward(
    model: Any,
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    kv_caches: list[torch.Tensor],
    attn_metadata: Any,
    hidden_size: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The final hidden states [T, hidden_size] on the last stage; None on the others
    (their output went to the next stage)."""
    ranks = get_parallel_rank()
    intermediate = None
    if not ranks.is_first_stage:
        shape = (2, input_ids.shape[0], hidden_size)
        received = recv_from_prev_stage(shape, dtype, input_ids.device)  # [2, T, hidden]
        intermediate = (received[0], received[1])
    out = model(input_ids, positions, kv_caches, attn_metadata, intermediate)
    if ranks.is_last_stage:
        return out
    hidden, residual = out
    send_to_next_stage(torch.stack((hidden, residual)))  # [2, T, hidden]
    return None
