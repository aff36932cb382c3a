"""Parameters of a pooling (embedding) request, with vLLM's `PoolingParams` names.

A pooling request is prefill only: the engine computes the prompt, pools the final (normed)
hidden states of its tokens as the engine's `PoolerConfig.pooling_type` says (LAST, MEAN or
CLS), and returns the vector as one `PoolingRequestOutput`; nothing is sampled.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.api.sampling_params import RequestOutputKind
from engine.config.pooler import matryoshka_dimensions

if TYPE_CHECKING:
    from engine.config.pooler import PoolerConfig
    from engine.config.resolved import ModelConfig


@dataclass
class PoolingParams:
    """How to pool the hidden states of one prompt.

    `normalize`: L2-normalise the pooled vector (what embedding models expect); None: the
    engine's `PoolerConfig.normalize` (True unless the model says otherwise).
    `dimensions`: keep only the first `dimensions` values of the pooled vector, before it is
    normalised (Matryoshka embeddings); only for models that declare Matryoshka support.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    # A pooling request has exactly one output, when it finishes (vLLM's field).
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    # Set by `verify`: whether the request must compute every prompt token itself, so
    # that it may take no prefix-cache hit (MEAN and CLS pooling read every position).
    skip_reading_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}.")
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int)
            or isinstance(self.dimensions, bool)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive int, got {self.dimensions!r}.")
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError(
                f"output_kind must be RequestOutputKind.FINAL_ONLY for pooling, "
                f"got {self.output_kind!r}."
            )

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)

    def verify(self, pooler_config: PoolerConfig, model_config: ModelConfig) -> None:
        """Checks the request against the model and fills in the engine's defaults (vLLM's
        `PoolingParams.verify`): call it on the engine's own copy."""
        if self.normalize is None:
            self.normalize = pooler_config.normalize is not False
        self.skip_reading_prefix_cache = pooler_config.pooling_type in ("MEAN", "CLS")
        if self.dimensions is None:
            return
        hidden_size = int(model_config.hf_config.hidden_size)
        if self.dimensions > hidden_size:
            raise ValueError(
                f"dimensions={self.dimensions} exceeds the model's hidden size ({hidden_size})."
            )
        supported, allowed = matryoshka_dimensions(model_config.hf_config)
        name = model_config.served_model_name
        if not supported:
            raise ValueError(
                f"dimensions: model {name!r} does not support Matryoshka embeddings (its "
                "config.json has no is_matryoshka or matryoshka_dimensions), so its "
                "embeddings cannot be shortened."
            )
        if allowed is not None and self.dimensions not in allowed:
            raise ValueError(
                f"dimensions={self.dimensions}: model {name!r} supports only the Matryoshka "
                f"dimensions {allowed}."
            )
