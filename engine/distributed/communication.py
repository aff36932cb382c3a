"""The collectives the model calls, over this rank's groups (engine/distributed/
parallel_state.py). In a world of one each is the identity, so single-process code pays
nothing for them. Each rank counts its collectives and the time spent in them
(`COLLECTIVE_STATS`; the benchmarks report the all-reduce time per step)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from engine.distributed.parallel_state import CollectiveError, ParallelRank, get_parallel_rank


@dataclass
class CollectiveStats:
    """What this rank spent in collectives since it started (wall time, seconds)."""

    num_all_reduce: int = 0
    all_reduce_s: float = 0.0
    num_gather: int = 0
    gather_s: float = 0.0
    num_stage_transfers: int = 0  # sends and receives between pipeline stages
    stage_transfer_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


COLLECTIVE_STATS = CollectiveStats()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the stage's TP ranks, in place (row-parallel outputs, embeddings)."""
    ranks = get_parallel_rank()
    if ranks.tp_size == 1:
        return x
    import torch.distributed as dist

    start = time.perf_counter()
    with _raising_collective_error("all_reduce"):
        dist.all_reduce(x, group=ranks.tp_group)
    COLLECTIVE_STATS.num_all_reduce += 1
    COLLECTIVE_STATS.all_reduce_s += time.perf_counter() - start
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
    start = time.perf_counter()
    parts = None if ranks.tp_rank != 0 else [torch.empty_like(x) for _ in range(ranks.tp_size)]
    with _raising_collective_error("gather"):
        dist.gather(x, parts, dst=dst, group=ranks.tp_group)
    COLLECTIVE_STATS.num_gather += 1
    COLLECTIVE_STATS.gather_s += time.perf_counter() - start
    return None if parts is None else torch.cat(parts, dim=-1)


def send_to_next_stage(x: torch.Tensor) -> None:
    """Hands a stage's output (hidden states, and the residual stream where the family
    keeps one, stacked) to the same TP shard of the next stage."""
    ranks = _stage_ranks()
    import torch.distributed as dist

    start = time.perf_counter()
    with _raising_collective_error("send to the next stage"):
        dist.send(x.contiguous(), ranks.global_rank(ranks.pp_rank + 1, ranks.tp_rank))
    COLLECTIVE_STATS.num_stage_transfers += 1
    COLLECTIVE_STATS.stage_transfer_s += time.perf_counter() - start


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The previous stage's output; every rank knows its shape from the step itself."""
    ranks = _stage_ranks()
    import torch.distributed as dist

    x = torch.empty(shape, dtype=dtype, device=device)
    start = time.perf_counter()
    with _raising_collective_error("receive from the previous stage"):
        dist.recv(x, ranks.global_rank(ranks.pp_rank - 1, ranks.tp_rank))
    COLLECTIVE_STATS.num_stage_transfers += 1
    COLLECTIVE_STATS.stage_transfer_s += time.perf_counter() - start
    return x


def _stage_ranks() -> ParallelRank:
    ranks = get_parallel_rank()
    if ranks.pp_size == 1:
        raise RuntimeError("stage-to-stage transfer needs pipeline_parallel_size > 1.")
    return ranks


@contextlib.contextmanager
def _raising_collective_error(op: str) -> Iterator[None]:
    """gloo and NCCL raise a RuntimeError (a reset connection, a timeout) when a peer dies;
    tagged, the driver knows to name the peer rather than this rank."""
    try:
        yield
    except RuntimeError as exc:
        raise CollectiveError(f"{op} failed: {exc}") from exc
