"""Structured outputs: constraints (JSON schema, regex, choice, grammar) enforced with token
masks from a grammar engine. See docs/structured_outputs.md."""

from engine.api.structured_outputs import StructuredOutputsParams
from engine.structured_output.config import DecodingConfig

__all__ = ["DecodingConfig", "StructuredOutputsParams"]
