"""How an engine pools hidden states for pooling (embedding) requests: vLLM's `PoolerConfig`.

One pooling type per engine (per model), as in vLLM:

    LAST  the final normed hidden state of the last prompt token (causal embedding models)
    MEAN  the mean of the final normed hidden states of all prompt tokens
    CLS   the first prompt token's

Unset fields come from the model directory when it is a sentence-transformers model
(`modules.json` listing a `sentence_transformers.models.Pooling` module, whose
`config.json` sets one `pooling_mode_*`; a `Normalize` module turns normalisation on), else
LAST with normalisation. Plain Python, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")

_ST_POOLING_MODULE = "sentence_transformers.models.Pooling"
_ST_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# sentence-transformers' pooling modes, in the order vLLM checks them.
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


@dataclass(frozen=True)
class PoolerConfig:
    """`pooling_type`: "LAST", "MEAN" or "CLS" (any case); None: the model's, else LAST.
    `normalize`: the default of `PoolingParams.normalize`; None: the model's, else True."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or (
                self.pooling_type.upper() not in POOLING_TYPES
            ):
                raise ValueError(
                    f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                    f"got {self.pooling_type!r}."
                )
            object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}.")

    @classmethod
    def from_value(cls, value: PoolerConfig | dict[str, Any] | None) -> PoolerConfig:
        """A `PoolerConfig` from what `EngineArgs.pooler_config` holds."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"pooling_type", "normalize"}
            if unknown:
                raise ValueError(
                    f"pooler_config has unknown keys {sorted(unknown)}; "
                    "it takes pooling_type and normalize."
                )
            return cls(**value)
        raise TypeError(
            f"pooler_config must be a PoolerConfig, a dict or None, got {type(value).__name__}."
        )

    def resolve(self, model_dir: Path | None) -> PoolerConfig:
        """Every field set: the caller's values, then the model directory's, then the
        defaults (LAST, normalize)."""
        model = sentence_transformers_pooling(model_dir) if model_dir is not None else {}
        pooling_type = self.pooling_type or model.get("pooling_type") or "LAST"
        normalize = self.normalize
        if normalize is None:
            normalize = model.get("normalize", True)
        return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def sentence_transformers_pooling(model_dir: Path) -> dict[str, Any]:
    """{"pooling_type": ..., "normalize": ...} from a sentence-transformers model directory;
    {} when it is not one (or names a pooling mode this engine does not have)."""
    modules = _read_json(Path(model_dir) / "modules.json")
    if not isinstance(modules, list):
        return {}
    pooling = next(
        (m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING_MODULE), None
    )
    if pooling is None:
        return {}
    config = _read_json(Path(model_dir) / str(pooling.get("path", "")) / "config.json")
    if not isinstance(config, dict):
        return {}
    pooling_type = next((t for key, t in _ST_POOLING_MODES.items() if config.get(key)), None)
    if pooling_type is None:
        return {}
    normalize = any(isinstance(m, dict) and m.get("type") == _ST_NORMALIZE_MODULE for m in modules)
    return {"pooling_type": pooling_type, "normalize": normalize}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def matryoshka_dimensions(hf_config: Any) -> tuple[bool, list[int] | None]:
    """(whether the model declares Matryoshka embeddings, the sizes it lists or None), from
    `is_matryoshka` / `matryoshka_dimensions` in its config.json, as vLLM reads them."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return True, [int(d) for d in dims]
    return bool(getattr(hf_config, "is_matryoshka", False)), None
