"""Batch-invariant layers (EngineArgs `batch_invariant`, docs/determinism.md): each op computes
a row the same way whatever else is in the batch. `make_batch_invariant` puts a built model's
linear layers and LM head on the batch-invariant kernel; attention is the backend's
(engine/attention/cpu_invariant_backend.py)."""

from engine.layers.batch_invariant.linear import (
    InvariantLinearMethod,
    InvariantPlan,
    make_batch_invariant,
)

__all__ = ["InvariantLinearMethod", "InvariantPlan", "make_batch_invariant"]
