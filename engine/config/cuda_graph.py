"""Which decode batch sizes get a CUDA graph: `EngineArgs.cuda_graph_sizes` and
`enforce_eager`, resolved once into `CudaGraphConfig`. Plain Python, no torch.

A captured graph replays a fixed launch sequence for one batch size, so a decode step of n
requests runs the graph of the smallest captured size >= n, its spare rows padding
(engine/worker/cuda_graphs.py). The default list is vLLM's: fine steps where padding would
waste the most (small batches), coarser ones above::

    1, 2, 4, 8, 16, 24, ..., 248 (step 8), 256, 272, ..., 512 (step 16)

capped by `max_num_seqs`, the largest decode batch the scheduler can form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_CUDA_GRAPH_SIZES: tuple[int, ...] = (
    1,
    2,
    4,
    *range(8, 256, 8),
    *range(256, 512 + 1, 16),
)


@dataclass(frozen=True)
class CudaGraphConfig:
    """`capture_sizes`: ascending batch sizes to capture; empty = every step runs eagerly
    (on CPU, with `enforce_eager`, or when the list is capped away)."""

    capture_sizes: tuple[int, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.capture_sizes)

    @property
    def max_capture_size(self) -> int:
        return self.capture_sizes[-1] if self.capture_sizes else 0

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a decode batch of `num_reqs` runs at; None: larger than every
        captured size (or none captured), so the step runs eagerly."""
        for size in self.capture_sizes:
            if size >= num_reqs:
                return size
        return None


def cap_graph_sizes(sizes: Sequence[int], max_num_seqs: int) -> tuple[int, ...]:
    """`sizes` sorted, deduplicated and capped at `max_num_seqs`. When the cap falls between
    two listed sizes it is added itself, so that every batch the scheduler can form up to the
    list's largest size has a graph (max_num_seqs=10 over 1, 2, 4, 8, 16 gives 1, 2, 4, 8,
    10, not a largest graph of 8 that batches of 9 and 10 miss)."""
    ordered = sorted(set(sizes))
    capped = [s for s in ordered if s <= max_num_seqs]
    if ordered and ordered[-1] > max_num_seqs and max_num_seqs not in capped:
        capped.append(max_num_seqs)
    return tuple(capped)


def resolve_cuda_graph_config(
    cuda_graph_sizes: Sequence[int] | None,
    enforce_eager: bool,
    device: str,
    max_num_seqs: int,
) -> CudaGraphConfig:
    """The sizes to capture; checks the user's list. Graphs are a CUDA feature: on CPU the
    list is empty whatever was asked."""
    if cuda_graph_sizes is None:
        sizes: Sequence[int] = DEFAULT_CUDA_GRAPH_SIZES
    else:
        if isinstance(cuda_graph_sizes, str | bytes) or not isinstance(cuda_graph_sizes, Sequence):
            raise ValueError(
                f"cuda_graph_sizes must be a list of ints or None, got {cuda_graph_sizes!r}."
            )
        bad = [s for s in cuda_graph_sizes if isinstance(s, bool) or not isinstance(s, int)]
        bad += [s for s in cuda_graph_sizes if isinstance(s, int) and s < 1]
        if bad:
            raise ValueError(f"cuda_graph_sizes must hold ints >= 1, got {list(bad)}.")
        sizes = cuda_graph_sizes
    if enforce_eager or not device.startswith("cuda"):
        return CudaGraphConfig()
    return CudaGraphConfig(cap_graph_sizes(sizes, max_num_seqs))
