"""Top-k, top-p (nucleus) and min-p filtering of random rows, per row, vectorised.

The filters work on probabilities (softmax at the row's temperature) and drop a token by
zeroing it; the inverse-CDF draw needs no renormalisation. Each filter keeps the tokens whose
probability reaches a per-row cutoff, so tokens tying with the cutoff are all kept (with
exact ties top-k may keep more than k tokens). A row with a filter off gets cutoff 0, which
leaves its probabilities untouched bit for bit, whatever the other rows ask for.

Top-p needs the row's probabilities in descending order down to the edge of the nucleus.
A full sort of [B, V] is slow on CPU (~200 ms for 64 x 49152) while most nuclei hold a few
hundred tokens at most, so on CPU we first try the top 256 / 4096 and sort only when some
row's nucleus is larger. The cutoff does not depend on how long that prefix is: the prefix
holds the same values, and a CPU cumsum adds them in order, so its first L sums are the
same for any prefix length.
"""

from __future__ import annotations

import torch

_CPU_PREFIX_LENGTHS = (256, 4096)


def apply_top_k_top_p(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int,
) -> torch.Tensor:
    """Zeroes the tokens outside each row's top-k, then outside its top-p nucleus.

    probs: [B, V] float32 (softmax after temperature), modified in place and returned.
    top_k: [B] int64, 0 = off; max_top_k: the largest top_k. top_p: [B] float32, 1 = off.
    The nucleus is the smallest set of most likely tokens (among the top-k, renormalised)
    whose mass reaches top_p.
    """
    if top_k is None and top_p is None:
        return probs
    if top_p is None:
        assert top_k is not None
        values = probs.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
        return _zero_below_(probs, _top_k_cutoff(values, top_k))

    vocab_size = probs.shape[-1]
    top_p = top_p.unsqueeze(-1)  # [B, 1]
    lengths = _prefix_lengths(probs.device, vocab_size, max_top_k)
    values = _descending(probs, lengths[0])  # [B, L], L >= max_top_k
    k_cutoff = None if top_k is None else _top_k_cutoff(values, top_k)  # [B, 1]
    if k_cutoff is not None:
        _zero_below_(probs, k_cutoff)
    # Summed in vocabulary order, so it does not depend on the prefix length.
    target = top_p * probs.sum(-1, keepdim=True).double()  # [B, 1]
    for i, length in enumerate(lengths):
        if i > 0:
            values = _descending(probs, length)
        if k_cutoff is not None:
            _zero_below_(values, k_cutoff)
        cumulative = values.cumsum(-1, dtype=torch.float64)  # [B, length]
        covered = (cumulative[:, -1:] >= target) | (top_p >= 1.0)
        if length == vocab_size or bool(covered.all()):
            break
    # Sorted token i is kept while the mass of tokens 0..i-1 is below the target: the
    # tokens up to and including the first whose cumulative mass reaches it.
    num_below = (cumulative < target).sum(-1, keepdim=True)  # [B, 1]
    num_kept = (num_below + 1).clamp(max=length)  # [B, 1], >= 1
    p_cutoff = torch.where(top_p < 1.0, values.gather(-1, num_kept - 1), 0.0)  # [B, 1]
    return _zero_below_(probs, p_cutoff)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Zeroes the probabilities below min_p times the row's largest one.

    probs: [B, V] (need not sum to 1), modified in place and returned. min_p: [B]
    float32, 0 = off.
    """
    if min_p is None:
        return probs
    threshold = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return _zero_below_(probs, threshold)


def _top_k_cutoff(values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The k-th largest probability of each row ([B, 1]), 0 where top-k is off.

    values: [B, L] descending, L >= every enabled top_k.
    """
    kth_index = (top_k.clamp(min=1) - 1).clamp(max=values.shape[-1] - 1)  # [B]
    kth_value = values.gather(-1, kth_index.unsqueeze(-1))  # [B, 1]
    return torch.where((top_k > 0).unsqueeze(-1), kth_value, 0.0)


def _zero_below_(probs: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    return probs.masked_fill_(probs < cutoff, 0.0)


def _descending(probs: torch.Tensor, length: int) -> torch.Tensor:
    """The `length` largest values of each row, largest first."""
    if length >= probs.shape[-1]:
        return probs.sort(dim=-1, descending=True).values
    return probs.topk(length, dim=-1).values


def _prefix_lengths(device: torch.device, vocab_size: int, max_top_k: int) -> list[int]:
    """Prefix lengths to try, ending with the whole row. Off CPU, sort at once: a GPU
    sorts fast, and a host sync to check coverage would cost more."""
    if device.type != "cpu":
        return [vocab_size]
    first = max(_CPU_PREFIX_LENGTHS[0], max_top_k)
    lengths = [first] + [n for n in _CPU_PREFIX_LENGTHS[1:] if n > first]
    return [n for n in lengths if n < vocab_size // 4] + [vocab_size]
