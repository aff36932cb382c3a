"""Pure-torch references for the Triton kernels: plain loops and fp32 math, written for
clarity rather than speed. The tests compare every kernel against these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ref_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows of no request are zero
    """Causal attention per request: gather its keys/values position by position, then
    softmax(q k^T * scale) v in fp32 with query token i at position seq_len - q_len + i
    (scores soft-capped to cap * tanh(s / cap) where `logits_soft_cap` is given; with
    `sliding_window`, each query sees only its last `sliding_window` positions, its own
    included; with `sinks` [num_heads], each head's sink logit is one more column of the
    softmax, dropped after it, as transformers' GPT-OSS eager attention does). A bf16/fp16
    cache is read as stored, widened to fp32."""
    out = torch.zeros_like(query)
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    starts = query_start_loc.tolist()
    for req, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[req], starts[req + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        positions = torch.arange(seq_len, device=query.device)
        block_ids = block_tables[req, positions // block_size].long()
        offsets = positions % block_size
        key = kv_cache[0, block_ids, offsets].float()  # [seq_len, num_kv_heads, head_dim]
        value = kv_cache[1, block_ids, offsets].float()
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [seq_len, H, D]
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, key) * scale  # [H, q_len, seq_len]
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        visible = positions[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window is not None:
            visible &= positions[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is not None:
            column = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, value).to(query.dtype)
    return out


def ref_write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Writes in place: flat slot s is kv_cache[:, s // block_size, s % block_size]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0, slots] = key[valid]
    flat[1, slots] = value[valid]


def ref_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face LlamaRMSNorm, after `x + residual` in the model dtype when given."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return (out, x) if residual is not None else out


def ref_rotary(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos | sin
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns rotated copies: x * cos + rotate_half(x) * sin, in fp32, rounded once."""
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[positions.long()].float()  # [num_tokens, head_dim]
    cos = torch.cat([rows[:, :half], rows[:, :half]], dim=-1)[:, None, :]
    sin = torch.cat([rows[:, half:], rows[:, half:]], dim=-1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        rotated_half = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        return (x32 * cos + rotated_half * sin).to(x.dtype)

    return rotate(query), rotate(key)


def ref_rotary_cos_sin(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]: (c | c)
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]: (-s | s)
) -> torch.Tensor:
    """A rotated copy from the engine's per-token cos/sin (engine/layers/rope.py's form):
    x * cos + swap_halves(x) * sin, in fp32, rounded once."""
    half = x.shape[-1] // 2
    x32 = x.float()
    swapped = torch.cat([x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos.float() + swapped * sin.float()).to(x.dtype)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up], in fp32, rounded once."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def ref_moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """A mixture-of-experts MLP as transformers computes it (one-hot mask, a Python loop
    over the experts hit, gather and index_add each): the reference of the grouped paths
    (engine/layers/moe.py) and the baseline of benchmarks/cpu_paths/moe.py. w13 [E, 2 I, H] holds
    each expert's gate | up rows, w2 [E, H, I]; weights and ids are [T, top_k]."""
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)  # [E, top_k, T]
    for expert in torch.nonzero(mask.sum(dim=(1, 2))).flatten().tolist():
        pos, token = torch.where(mask[expert])
        h = ref_silu_and_mul(F.linear(x[token], w13[expert]))
        y = F.linear(h, w2[expert]) * weights[token, pos, None]
        out.index_add_(0, token, y)
    return out


def ref_int4_dequantize(
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    group_size: int,
) -> torch.Tensor:  # [K, N] fp32
    """kernels/int4_gemm.py's weight unpacked nibble by nibble (nibble i of row r is input
    8 r + i), dequantized in fp32: (code - zero) * scale of the row's group."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    out = torch.empty(k, n, dtype=torch.float32)
    packed = qweight.cpu().to(torch.int64) & 0xFFFFFFFF  # as unsigned 32-bit words
    for row in range(k):
        codes = (packed[row // 8] >> (4 * (row % 8))) & 0xF  # [N]
        group = row // group_size
        out[row] = (codes.float() - zeros[group].float().cpu()) * scales[group].float().cpu()
    return out.to(qweight.device)


def ref_int4_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:  # [M, N] fp32
    return x.float() @ ref_int4_dequantize(qweight, scales, zeros, group_size)
