"""Batched LoRA for one linear layer over a batch that mixes the base model and several
adapters (the "punica" shrink / expand pair).

Adapters live in slots of stacked, rank-padded tensors; each token carries the slot of its
request's adapter, or -1 for the base model::

    a_stacked  [num_slots, max_rank, in_features]    lora_A, zero rows past an adapter's rank
    b_stacked  [num_slots, out_features, max_rank]   scaling * lora_B, zero columns past it
    indices    [num_tokens]                          slot per token, -1 = no adapter

    shrink:  h[t] = a_stacked[indices[t]] @ x[t]     [num_tokens, max_rank]
    expand:  y[t] += b_stacked[indices[t]] @ h[t]    [num_tokens, out_features]

Zero padding makes the padded ranks contribute nothing, so adapters of different ranks share
one stack. Two implementations with the same contract:
- `add_lora_reference`: per-token gathers and batched matmuls; the plain statement of the
  math (memory grows with num_tokens x out_features x max_rank).
- `add_lora`: one pair of GEMMs per adapter *slot* present in the batch (at most
  `max_loras`, never one per request), on the rows that slot owns; the CPU path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.lora.adapter import LoRALayerWeights


def stack_lora_weights(
    slots: Sequence[LoRALayerWeights | None],
    max_rank: int,
    out_features: int,
    in_features: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_stacked, b_stacked) for one layer; a None slot (or an adapter that does not target
    this layer) is all zeros, so its tokens get the base output."""
    a_stacked = torch.zeros(len(slots), max_rank, in_features, dtype=dtype, device=device)
    b_stacked = torch.zeros(len(slots), out_features, max_rank, dtype=dtype, device=device)
    for slot, weights in enumerate(slots):
        if weights is None:
            continue
        rank = weights.lora_a.shape[0]
        if rank > max_rank:
            raise ValueError(f"slot {slot}: rank {rank} is greater than max_rank={max_rank}.")
        a_stacked[slot, :rank] = weights.lora_a
        b_stacked[slot, :, :rank] = weights.scaling * weights.lora_b
    return a_stacked, b_stacked


def _check(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, indices: torch.Tensor
) -> None:
    num_tokens, in_features = x.shape
    num_slots, max_rank, a_in = a.shape
    assert a_in == in_features, f"a_stacked in_features {a_in} != x's {in_features}"
    assert b.shape == (num_slots, y.shape[1], max_rank), f"b_stacked shape {tuple(b.shape)}"
    assert y.shape[0] == num_tokens and indices.shape == (num_tokens,)
    assert not indices.dtype.is_floating_point, "indices must be integers"


def add_lora_reference(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    a_stacked: torch.Tensor,  # [num_slots, max_rank, in_features]
    b_stacked: torch.Tensor,  # [num_slots, out_features, max_rank]
    indices: torch.Tensor,  # [num_tokens] slot per token, -1 = none
) -> torch.Tensor:
    _check(y, x, a_stacked, b_stacked, indices)
    active = indices >= 0  # [num_tokens]
    slot = indices.clamp(min=0).long()
    a = a_stacked[slot]  # [num_tokens, max_rank, in_features]
    h = torch.bmm(a, x.unsqueeze(-1))  # [num_tokens, max_rank, 1]
    b = b_stacked[slot]  # [num_tokens, out_features, max_rank]
    delta = torch.bmm(b, h).squeeze(-1)  # [num_tokens, out_features]
    y += torch.where(active.unsqueeze(-1), delta, torch.zeros_like(delta)).to(y.dtype)
    return y


def add_lora(
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    a_stacked: torch.Tensor,  # [num_slots, max_rank, in_features]
    b_stacked: torch.Tensor,  # [num_slots, out_features, max_rank]
    indices: torch.Tensor,  # [num_tokens] slot per token, -1 = none
) -> torch.Tensor:
    _check(y, x, a_stacked, b_stacked, indices)
    # One host sync for the few slots present; then one shrink and one expand GEMM each.
    for slot in torch.unique(indices).tolist():
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(-1)  # [num_rows]
        h = x.index_select(0, rows) @ a_stacked[slot].T  # [num_rows, max_rank]
        y.index_add_(0, rows, (h @ b_stacked[slot].T).to(y.dtype))  # [num_rows, out]
    return y
