"""Greedy tokens without the fp32 LM head: an 8-bit screen, then an exact rescore.

A greedy row needs only the argmax of its logits, not all of them. The screen
(engine/native/greedy_screen.c) computes every logit of a row in 8-bit arithmetic with a
proven bound on its error, which rules out every token but a few (3.4 a row on average on
the default model with VNNI, 14 on AVX2); those are rescored in fp32 against the LM head's
own rows (as the model stores them: fp32, or GGUF blocks dequantized), and the largest
wins, ties to the lowest id as `argmax` does. The token is the argmax of the fp32 logits,
up to their summation order (the same latitude as any two GEMM kernels), for less than
half the LM head's time at 64 rows with VNNI (docs/benchmarks.md).

The step's sampler (engine/worker/step_sampler.py) sends it the rows that want nothing
but the argmax: greedy, no logprobs, penalties, biases, allowed or bad words, logits
processors or grammar, and no min_tokens still banning stop tokens. The model builds one
after loading (`DecoderForCausalLM.pack_weights`) where the screen runs: x86 CPUs with
AVX2 or AVX-512 (VNNI's byte products where there are), an fp32 or CPU-quantized LM head,
one tensor-parallel rank, and the family's logits the plain projection (no soft-capping or
scaling after it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.native import greedy_screen as native_screen
from engine.native.quant import QuantizedWeight

logger = logging.getLogger(__name__)


class GreedyScreen:
    def __init__(
        self,
        weights: native_screen.ScreenWeights,
        head: QuantizedWeight,  # the LM head as stored (an F32 view of an fp32 weight)
        full_logits: Callable[[torch.Tensor], torch.Tensor],  # [N, hidden] -> [N, vocab]
    ) -> None:
        self.weights = weights
        self.head = head
        self._full_logits = full_logits

    @classmethod
    def build(
        cls, head: QuantizedWeight, full_logits: Callable[[torch.Tensor], torch.Tensor]
    ) -> GreedyScreen | None:
        """The screen of `head` ([vocab, hidden] in any storage of engine.native.quant), or
        None where this CPU has none. `full_logits` serves the rows the screen cannot
        (hidden states that are not finite, the kernels forced to the portable path later)."""
        if not native_screen.supported():
            return None
        try:
            weights = native_screen.pack_lm_head(
                head.dequantize, head.out_features, head.in_features
            )
        except ValueError as error:  # a head that is not finite: its logits say so as before
            logger.warning("No greedy screen: %s", error)
            return None
        logger.info("Greedy screen: LM head packed to 8 bits (%.1f MiB).", weights.nbytes / 2**20)
        return cls(weights, head, full_logits)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] fp32 -> [N] int64: the argmax of each row's fp32 logits."""
        try:
            tokens, _ = native_screen.screen_argmax(self.weights, self.head, hidden)
        except native_screen.ScreenUnavailable:
            return self._full_logits(hidden).argmax(dim=-1)
        return tokens
