"""Structured outputs: constraints (JSON schema, regex, choice, grammar) enforced with token
masks from a grammar engine. See docs/structured_outputs.md."""

from engine.structured_output.config import DecodingConfig
from engine.structured_output.params import StructuredOutputsParams

__all__ = ["DecodingConfig", "StructuredOutputsParams"]
