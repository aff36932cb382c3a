"""Turning logits into tokens and logprobs, vectorised over the batch."""

from engine.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from engine.sample.metadata import SamplingMetadata, SamplingRow
from engine.sample.rng import uniform
from engine.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "compute_logprobs",
    "gather_logprobs",
    "uniform",
]
