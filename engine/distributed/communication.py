"""The collectives the model calls, over this rank's groups (engine/distributed/
parallel_state.py). In a world of one each is the identity, so single-process code pays
nothing for them."""

from __future__ import annotations

import torch

from engine.distributed.parallel_state import ParallelRank, get_parallel_rank


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the stage's TP ranks, in place (row-parallel outputs, embeddings)."""
    ranks = get_parallel_rank()
    if ranks.tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=ranks.tp_group)
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenates the TP ranks' `x` along the last dimension on TP rank 0 (vocabulary-
    parallel logits); None on the other ranks, which do not sample."""
    ranks = get_parallel_rank()
    if ranks.tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    dst = ranks.global_rank(ranks.pp_rank, 0)
    if ranks.tp_rank != 0:
        dist.gather(x, None, dst=dst, group=ranks.tp_group)
        return None
    parts = [torch.empty_like(x) for _ in range(ranks.tp_size)]
    dist.gather(x, parts, dst=dst, group=ranks.tp_group)
    return torch.cat(parts, dim=-1)


def send_to_next_stage(x: torch.Tensor) -> None:
    """Hands a stage's output (hidden states, and the residual stream where the family
    keeps one, stacked) to the same TP shard of the next stage."""
    ranks = _stage_ranks()
    import torch.distributed as dist

    dist.send(x.contiguous(), ranks.global_rank(ranks.pp_rank + 1, ranks.tp_rank))


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The previous stage's output; every rank knows its shape from the step itself."""
    ranks = _stage_ranks()
    import torch.distributed as dist

    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, ranks.global_rank(ranks.pp_rank - 1, ranks.tp_rank))
    return x


def _stage_ranks() -> ParallelRank:
    ranks = get_parallel_rank()
    if ranks.pp_size == 1:
        raise RuntimeError("stage-to-stage transfer needs pipeline_parallel_size > 1.")
    return ranks
