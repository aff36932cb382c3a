"""N-gram ("prompt lookup") drafts: copy what followed the last earlier occurrence of the
sequence's own suffix. No model, no torch.

    tokens   a b c d x y a b c   (n = 3: the suffix "a b c" occurred at index 0)
    drafts               d x y   (the tokens that followed it, up to num_speculative_tokens)

Where the tokens that followed run into the end of the sequence, the copy goes on from the
drafts themselves, as if the repeat continued (an LZ77-style overlapping copy)::

    tokens   a b a b         (n = 2: "a b" occurred 2 tokens earlier)
    drafts           a b a b

Longer suffixes are tried first (prompt_lookup_max down to prompt_lookup_min); the most
recent occurrence wins. Only the last `_MAX_SEARCH_TOKENS` tokens are searched, so a step
costs the same for any sequence length.
"""

from __future__ import annotations

from array import array

from engine.api.sampling_params import SamplingType
from engine.config.speculative import SpeculativeConfig
from engine.core.request import Request

_MAX_SEARCH_TOKENS = 4096


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]:
        """Up to `min(num_speculative_tokens, max_num_tokens)` drafts to follow `token_ids`;
        an empty list when no suffix n-gram occurred earlier."""
        k = self.num_speculative_tokens
        if max_num_tokens is not None:
            k = min(k, max_num_tokens)
        window = token_ids[-_MAX_SEARCH_TOKENS:]
        num = len(window)
        if k <= 0 or num < self.min_n + 1:
            return []
        # Token ids as fixed-width words, so a byte search finds token-aligned n-grams
        # (misaligned hits, whose offset is not a multiple of the word size, are skipped).
        words = array("I", window)
        size = words.itemsize
        data = words.tobytes()
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            pattern = data[(num - n) * size :]
            # An occurrence must end before the last token, so that a token follows it.
            end = (num - 1) * size
            while True:
                index = data.rfind(pattern, 0, end)
                if index < 0:
                    break
                if index % size == 0:
                    return _copy_forward(window, index // size + n, k)
                end = index + len(pattern) - 1  # look for an earlier, aligned occurrence
        return []


def _copy_forward(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens from `start` on, where position len(tokens) + j repeats the token
    `len(tokens) - start` positions before it (a draft, once past the end)."""
    drafts = list(tokens[start : start + k])
    distance = len(tokens) - start
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - distance])
    return drafts


def can_speculate(request: Request) -> bool:
    """Whether drafts may be verified for `request` this step: greedy with nothing that
    makes a position's token depend on more than the argmax of its logits (penalties,
    min_tokens still pending), no per-token logprobs, no stop strings (matched on text
    after the step), and in decode (every known token computed except the last)."""
    params = request.sampling_params
    return (
        params is not None
        and params.sampling_type == SamplingType.GREEDY
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and params.logprobs is None
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and not params.logits_processors
        and params.prompt_logprobs is None
        and not params.stop
        and request.num_output_tokens >= params.min_tokens
        and request.num_computed_tokens == request.num_tokens - 1
    )
