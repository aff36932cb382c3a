"""`ParallelConfig`: how one engine's model is split over ranks (vLLM's names).

Checked on its own here; whether a given model can be split so is checked against its
Hugging Face config at start-up (engine/distributed/sharding.py: verify_parallel_config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ExecutorBackend = Literal["uni", "mp"]


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's `ParallelConfig`: how one engine's model is split over ranks.

    `distributed_executor_backend`: "uni" runs the model in the engine's own process (a
    world of one); "mp" starts one worker process per rank (engine/distributed/), which
    the engine owns. None resolves to "uni" for a world of one, else "mp".
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size}: run more engine replicas "
                "behind the tokenizer service or a gateway instead (docs/deployment.md)."
            )
        backend = self.distributed_executor_backend
        if backend not in (None, "uni", "mp"):
            raise ValueError(
                f"distributed_executor_backend must be 'uni', 'mp' or None, got {backend!r}."
            )
        if backend == "uni" and self.world_size > 1:
            raise ValueError(
                "distributed_executor_backend='uni' runs one process, but tensor_parallel_size"
                f" x pipeline_parallel_size = {self.world_size}: use 'mp'."
            )
        if backend is None:  # resolved once, here: the config is frozen
            object.__setattr__(
                self, "distributed_executor_backend", "uni" if self.world_size == 1 else "mp"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
