"""`DecodingConfig`: which grammar backend enforces structured outputs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodingConfig:
    """vLLM's `DecodingConfig` (structured outputs config): the grammar backend's name."""

    backend: str = "xgrammar"
