"""The sampler: [B, V] logits -> one token per row (plus logprobs), vectorised over the batch.

    logits ─ grammar bitmask ─┬─ log_softmax ─────────────────────────┐  raw logprobs
                              └─ allowed ids, bad words, logit bias,   │
                                 logits processors                     │
            ─ min_tokens mask ─ penalties ─┬─ greedy rows: argmax ─────┼─▶ SamplerOutput
                                            └─ random rows: softmax(x / temperature),
                                               top-k, top-p, min-p (zeroing probabilities),
                                               inverse CDF at uniform(seed, position)

Random rows draw one counter-based uniform `u` each (engine/sample/rng.py) and take the
first token, in vocabulary order, whose cumulative probability exceeds `u * total`. A row's
token therefore depends only on its own logits, parameters, seed and position: never on the
other rows of the batch or their order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import native
from engine.sample.filters import apply_min_p, apply_top_k_top_p
from engine.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.sample.penalties import apply_min_tokens, apply_penalties
from engine.sample.rng import uniform
from engine.sample.token_controls import apply_grammar_bitmask_, apply_token_controls

_BLOCK_SIZE = 256  # tokens per block of the two-level inverse-CDF search


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Raw logprobs (before penalties and temperature) of the sampled token and the
    # max_num_logprobs most likely ones; None when no row asked for logprobs.
    logprobs: LogprobsTensors | None


Argmax = Callable[[torch.Tensor], torch.Tensor]  # [B, V] fp32 -> [B] int64, ties -> lowest id


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def native_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Rows over the threads (torch's CPU argmax is single-threaded: ≈5 ms for [64, 49152])."""
    return native.argmax(logits.contiguous())


def select_argmax(op_impl: str) -> Argmax:
    """The greedy argmax for a model whose ops use `op_impl` (engine/layers/ops.py's
    `select_op_impl`), chosen once when the runner is built: the native kernel where the
    model's ops are native, torch's elsewhere (`attention_backend="torch"` means torch)."""
    return native_argmax if op_impl == "native" else torch_argmax


class Sampler:
    """Stateless. The grammar mask is applied to `logits` in place (its rows with a grammar
    only): callers pass the step's own logits, not ones they read again; nothing else in
    the sampler modifies them. `argmax` is the greedy implementation (`select_argmax`)."""

    def __init__(self, argmax: Argmax = torch_argmax) -> None:
        self._argmax = argmax

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_rows
        assert logits.shape[1] == metadata.vocab_size
        if metadata.grammar_bitmask is not None:
            # Before the logprobs: they are those of the masked distribution (as vLLM).
            logits = apply_grammar_bitmask_(
                logits, metadata.grammar_bitmask, metadata.grammar_row_ids
            )
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)  # [B, V]

        logits = logits.to(torch.float32)
        logits = apply_token_controls(logits, metadata)
        logits = apply_min_tokens(logits, metadata)
        logits = apply_penalties(logits, metadata)
        sampled = self._sample(logits, metadata)  # [B]

        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None
        if not metadata.all_random:
            greedy = self._argmax(logits)  # [B]; ties -> lowest id
            if metadata.all_greedy:
                return greedy
        sampled = sample_random(logits, metadata)  # [B]
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature == 0.0, greedy, sampled)


def sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, filters, then one inverse-CDF draw per row. [B, V] -> [B] int64.

    Greedy rows (temperature 0) are computed at temperature 1; the caller drops them.
    """
    temperature = metadata.temperature
    temperature = torch.where(temperature == 0.0, 1.0, temperature).unsqueeze(-1)  # [B, 1]
    probs = (logits / temperature).softmax(dim=-1)  # [B, V]
    probs = apply_top_k_top_p(probs, metadata.top_k, metadata.top_p, metadata.max_top_k)
    probs = apply_min_p(probs, metadata.min_p)
    return sample_inverse_cdf(probs, uniform(metadata.seeds, metadata.positions))


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total, per row.

    probs: [B, V] non-negative, need not be normalised; u: [B] float64 in [0, 1).
    Two levels instead of one [B, V] float64 cumsum (several passes over the logits): sum
    blocks of 256 tokens, search the block cumsum (float64), then search the chosen
    block's own cumsum. A zero-probability token (or block) adds nothing to a cumulative
    sum, so it is never the first to exceed the target; both targets are kept strictly
    below their totals, so neither search runs off the end.
    """
    num_rows, vocab_size = probs.shape
    num_blocks = -(-vocab_size // _BLOCK_SIZE)
    padding = num_blocks * _BLOCK_SIZE - vocab_size
    if padding:
        probs = torch.nn.functional.pad(probs, (0, padding))  # zeros: never sampled
    blocks = probs.reshape(num_rows, num_blocks, _BLOCK_SIZE)
    block_cdf = blocks.sum(-1).cumsum(-1, dtype=torch.float64)  # [B, num_blocks]
    target = _below(u.unsqueeze(-1) * block_cdf[:, -1:], block_cdf[:, -1:])  # [B, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)
    mass_before = block_cdf.gather(-1, (block - 1).clamp(min=0))  # [B, 1]
    mass_before = torch.where(block > 0, mass_before, 0.0)
    index = block.unsqueeze(-1).expand(num_rows, 1, _BLOCK_SIZE)
    in_block_cdf = blocks.gather(1, index).squeeze(1).cumsum(-1, dtype=torch.float64)
    in_block_target = _below((target - mass_before).clamp(min=0.0), in_block_cdf[:, -1:])
    offset = torch.searchsorted(in_block_cdf, in_block_target, right=True)  # [B, 1]
    token_ids = (block * _BLOCK_SIZE + offset).squeeze(-1)
    # Only a row with no probability mass at all can land past its last token.
    return token_ids.clamp_(max=vocab_size - 1)


def _below(value: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """`value` capped at the largest float below `total` (0 stays 0)."""
    return torch.minimum(value, torch.nextafter(total, torch.zeros_like(total)))
