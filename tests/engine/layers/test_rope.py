"""Every rope type's cos/sin against transformers' own rotary embedding (its rope init
functions and its length-dependent update), over many positions and sequence lengths on
both sides of each threshold: the engine is compared token for token with transformers, so
the arithmetic must be transformers' own."""

from __future__ import annotations

import pytest
import torch

from engine.config.rope import RopeParameters, rope_parameters, rope_regime
from engine.layers.ops import apply_rotary_emb
from engine.layers.rope import RotaryEmbedding

HEAD_DIM, MAX_POS, ORIGINAL = 32, 128, 32
HALF = HEAD_DIM // 2
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
    "long_factor": [1.0 + 0.6 * i for i in range(HALF)],
    "original_max_position_embeddings": ORIGINAL,
}
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-betas-untruncated-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "truncate": False,
        "mscale": 0.9,
        "mscale_all_dim": 0.6,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "attention_factor": 1.3,
    },
    "longrope": LONGROPE,
    "longrope-attention-factor": {**LONGROPE, "attention_factor": 0.8},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}
# Sequence lengths either side of every threshold (ORIGINAL for longrope, MAX_POS for dynamic).
LENGTHS = (1, 17, ORIGINAL, ORIGINAL + 1, 70, MAX_POS, MAX_POS + 1, 2 * MAX_POS + 5)


def _config(rope: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters={**rope, "rope_theta": 50000.0},
    )


def _reference(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin for one forward over `positions` ([T]), from a fresh module
    (dynamic's keeps state between calls)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ref = LlamaRotaryEmbedding(config)
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]  # [T, head_dim]


@pytest.mark.parametrize("name", list(ROPES))
def test_cos_sin_match_transformers_over_lengths(name: str) -> None:
    """A forward over positions 0..L-1 (a prefill of length L) and a decode token at L-1
    (the rope length is the position + 1), for lengths either side of the thresholds."""
    config = _config(ROPES[name])
    params = rope_parameters(config)
    ours = RotaryEmbedding.from_parameters(HEAD_DIM, MAX_POS, params)
    max_len = params.max_length(MAX_POS)
    for length in (n for n in LENGTHS if n <= max_len):
        positions = torch.arange(length)
        ref_cos, ref_sin = _reference(config, positions)
        cos, sin = ours.cos_sin(positions, torch.float32, torch.full((length,), length))
        torch.testing.assert_close(cos[:, 0], ref_cos, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sin[:, 0, HALF:], ref_sin[:, HALF:], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sin[:, 0, :HALF], -ref_sin[:, :HALF], atol=1e-6, rtol=1e-5)
        # Without rope lengths a token's is its position + 1: the last one is the same row.
        last_cos, _ = ours.cos_sin(positions[-1:], torch.float32)
        torch.testing.assert_close(last_cos[:, 0], ref_cos[-1:], atol=1e-6, rtol=1e-5)


def test_mixed_batch_gives_each_token_its_own_scaling() -> None:
    """One call over tokens of several requests (a short prompt's prefill, a long prompt's
    prefill, decodes either side of the threshold) equals each one computed alone."""
    # (first position, tokens, rope length) per request, either side of each threshold.
    batches = {
        "longrope": [(0, 10, 10), (0, 100, 100), (20, 1, 21), (40, 1, 41), (5, 4, 9)],
        "dynamic": [(0, 10, 10), (0, 200, 200), (40, 1, 41), (150, 1, 151), (5, 4, 9)],
    }
    for name, requests in batches.items():
        config = _config(ROPES[name])
        ours = RotaryEmbedding.from_parameters(HEAD_DIM, MAX_POS, rope_parameters(config))
        positions = torch.cat([torch.arange(s, s + n) for s, n, _ in requests])
        lengths = torch.cat([torch.full((n,), max(ln, s + n)) for s, n, ln in requests])
        cos, sin = ours.cos_sin(positions, torch.float32, lengths)
        start = 0
        for first, count, length in requests:
            ref_cos, ref_sin = _reference(config, torch.arange(length))
            rows = slice(start, start + count)
            torch.testing.assert_close(cos[rows, 0], ref_cos[first : first + count])
            torch.testing.assert_close(sin[rows, 0, HALF:], ref_sin[first : first + count, HALF:])
            start += count


@pytest.mark.parametrize("name", ["yarn", "longrope", "dynamic", "llama3"])
def test_inverse_frequencies_and_attention_factor_match_rope_init_functions(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rope import inv_freq

    config = _config(ROPES[name])
    params = rope_parameters(config)
    hf_short, hf_factor = ROPE_INIT_FUNCTIONS[params.rope_type](config, "cpu")
    assert params.attention_factor(MAX_POS) == pytest.approx(hf_factor, rel=1e-12)
    torch.testing.assert_close(inv_freq(params, HEAD_DIM, MAX_POS), hf_short, atol=0, rtol=0)
    if name == "longrope":
        hf_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIGINAL + 1)
        ours_long = inv_freq(params, HEAD_DIM, MAX_POS, long=True)
        torch.testing.assert_close(ours_long, hf_long, atol=0, rtol=0)


def test_rotation_matches_transformers_apply_rotary_pos_emb() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = _config(ROPES["yarn"])
    ours = RotaryEmbedding.from_parameters(HEAD_DIM, MAX_POS, rope_parameters(config))
    positions = torch.tensor([0, 1, 7, 31, 33, 100, 127, 3])
    q, k = torch.randn(len(positions), 4, HEAD_DIM), torch.randn(len(positions), 2, HEAD_DIM)
    cos, sin = _reference(config, positions)
    q_ref, k_ref = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    q_ours, k_ours = ours(positions, q, k)
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    c, s = ours.cos_sin(positions, torch.float32)
    torch.testing.assert_close(apply_rotary_emb(q, c, s), q_ours, atol=0, rtol=0)


def test_regime_keys_recompute_and_lengths() -> None:
    """The block-hash key of a rope length: none within the threshold, one for every
    longrope length past it, the length itself for dynamic; longrope's recomputation when a
    sequence grows past the threshold; the length cap of each type."""
    longrope = rope_regime(_config(LONGROPE))
    assert longrope is not None
    assert longrope.key(ORIGINAL) is None and longrope.key(1) is None
    assert longrope.key(ORIGINAL + 1) == longrope.key(100) is not None
    assert longrope.admission_length(10, 40) == 40  # recomputed: the whole sequence's
    assert longrope.must_recompute(ORIGINAL, ORIGINAL + 1)
    assert not longrope.must_recompute(ORIGINAL, ORIGINAL)
    assert not longrope.must_recompute(ORIGINAL + 1, 90)
    dynamic = rope_regime(_config(ROPES["dynamic"]))
    assert dynamic is not None
    assert dynamic.key(MAX_POS) is None
    assert dynamic.key(MAX_POS + 1) != dynamic.key(MAX_POS + 2)
    assert dynamic.admission_length(10, 200) == 10  # the prompt's, whatever was generated
    assert not dynamic.must_recompute(10, 200)
    assert rope_regime(_config(ROPES["yarn"])) is None
    lengths = {n: rope_parameters(_config(r)).max_length(MAX_POS) for n, r in ROPES.items()}
    assert lengths["default"] == lengths["llama3"] == lengths["longrope"] == MAX_POS
    assert lengths["linear"] == 4 * MAX_POS and lengths["dynamic"] == 3 * MAX_POS
    assert lengths["yarn"] == 4 * ORIGINAL


def test_unknown_types_and_missing_keys_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="'mrope'"):
        RopeParameters(10000.0, "mrope")
    with pytest.raises(ValueError, match="long_factor"):
        RopeParameters(
            10000.0, "longrope", {"short_factor": [1.0], "original_max_position_embeddings": 4}
        )
