"""Which rank this process is, and its process groups.

A process that never called `init_distributed` is the only rank of a world of one: every
size is 1 and every collective is the identity, so the model code reads the same in a
single process and in a rank. Ranks are numbered tensor-parallel-major inside a pipeline
stage (vLLM's layout)::

    world_size = tp * pp        rank = pp_rank * tp + tp_rank

    tp=2, pp=2:   stage 0: ranks 0 1     stage 1: ranks 2 3
                  TP groups {0,1} {2,3}; stages talk point to point (rank r -> r + tp)
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


class CollectiveError(RuntimeError):
    """A collective (all-reduce, gather, a stage transfer) broke: usually a symptom, a peer
    rank died or stopped, so the driver looks for that rank before blaming this one."""


@dataclass(frozen=True)
class ParallelRank:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's TP ranks

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver_worker(self) -> bool:
        """The rank that samples and answers the driver: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def global_rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank


_SINGLE = ParallelRank()
_current: ParallelRank = _SINGLE


def get_parallel_rank() -> ParallelRank:
    """This process's rank (a world of one unless `init_distributed` ran)."""
    return _current


def init_distributed(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    backend: str,
    timeout_s: float = 600.0,
) -> ParallelRank:
    """Joins the world (`init_method`: a ``tcp://host:port`` rendezvous) and builds the TP
    groups; gloo on CPU, NCCL on CUDA."""
    import torch.distributed as dist

    global _current
    world_size = tp_size * pp_size
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    tp_group = None
    # Every rank creates every group, in the same order (new_group is collective).
    for stage in range(pp_size):
        group = dist.new_group([stage * tp_size + t for t in range(tp_size)])
        if stage == pp_rank:
            tp_group = group
    _current = ParallelRank(tp_rank, tp_size, pp_rank, pp_size, tp_group)
    return _current


def destroy_distributed() -> None:
    import torch.distributed as dist

    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = _SINGLE
