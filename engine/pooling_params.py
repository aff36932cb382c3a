"""Parameters of a pooling (embedding) request, with vLLM's `PoolingParams` names.

A pooling request is prefill only: the engine computes every prompt token, takes the final
(normed) hidden state of the last prompt token, and returns it as one
`PoolingRequestOutput`; nothing is sampled.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from engine.sampling_params import RequestOutputKind


@dataclass
class PoolingParams:
    """How to pool the hidden states of one prompt.

    `normalize`: L2-normalise the pooled vector (what embedding models expect).
    """

    normalize: bool = True
    # A pooling request has exactly one output, when it finishes (vLLM's field).
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}.")
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError(
                f"output_kind must be RequestOutputKind.FINAL_ONLY for pooling, "
                f"got {self.output_kind!r}."
            )

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)
