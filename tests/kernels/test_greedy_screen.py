"""The greedy screen (engine/native/greedy_screen.c, engine/layers/greedy_screen.py): its
argmax is that of the fp32 logits over odd shapes, outlier activations, near and exact
ties, Q8_0-exact and other quantized heads, rows that are not finite, every token a
candidate, each ISA path; and the portable path has none."""

from __future__ import annotations

import pytest
import torch

from engine.layers.greedy_screen import GreedyScreen
from engine.native import native_kernels_available
from engine.native.quant import QType, QuantizedWeight, fp32_weight

pytestmark = pytest.mark.skipif(
    not native_kernels_available(), reason="no C compiler: native kernels unavailable"
)


def _supported() -> bool:
    from engine.native import greedy_screen

    return greedy_screen.supported()


needs_screen = pytest.mark.skipif(
    not native_kernels_available() or not _supported(),
    reason="the greedy screen needs x86 AVX2 or AVX-512 kernels (this CPU or build has none)",
)


def _screen(weight: torch.Tensor, full_logits=None) -> GreedyScreen:
    screen = GreedyScreen.build(fp32_weight(weight), full_logits or (lambda h: h @ weight.T))
    assert screen is not None
    return screen


def _exact_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden.double() @ weight.double().T).argmax(dim=-1)


@needs_screen
@pytest.mark.parametrize(
    ("vocab", "hidden_size", "rows"),
    [(1000, 64, 1), (517, 72, 3), (49, 33, 8), (2048, 96, 13), (4099, 128, 64), (16, 32, 9)],
)
def test_argmax_of_the_fp32_logits_over_shapes(vocab, hidden_size, rows):
    from engine.native.greedy_screen import screen_argmax

    gen = torch.Generator().manual_seed(vocab + hidden_size + rows)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.05
    hidden = torch.randn(rows, hidden_size, generator=gen)
    hidden[:, 0] *= 40.0  # an outlier channel, as real hidden states have
    screen = _screen(weight)
    tokens, counts = screen_argmax(screen.weights, screen.head, hidden)
    assert torch.equal(tokens, _exact_argmax(hidden, weight))
    assert bool((counts >= 1).all() and (counts <= vocab).all())
    assert torch.equal(screen.argmax(hidden), tokens)


@needs_screen
def test_screen_rules_out_most_tokens_on_a_peaked_head():
    """Trained heads give most rows one clear winner: the screen must then list only a
    few tokens (else it saves nothing)."""
    from engine.native.greedy_screen import screen_argmax

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(4096, 64, generator=gen) * 0.05
    targets = torch.randint(0, 4096, (32,), generator=gen)
    hidden = weight[targets] * 400.0 + torch.randn(32, 64, generator=gen) * 0.1
    screen = _screen(weight)
    tokens, counts = screen_argmax(screen.weights, screen.head, hidden)
    assert torch.equal(tokens, _exact_argmax(hidden, weight))
    assert float(counts.float().mean()) < 4.0, counts


@needs_screen
def test_near_and_exact_ties():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 64, generator=gen) * 0.05
    weight[200] = weight[100]  # an exact tie: the lower id wins, as argmax
    weight[250] = weight[50] * (1 + 2e-6)  # a near tie the 8-bit screen cannot split
    hidden = torch.stack([weight[100] * 50, weight[50] * 50, -weight[50] * 50])
    tokens = _screen(weight).argmax(hidden)
    assert tokens[0] == 100
    assert tokens[1] == 250  # |w250| > |w50| along w50's own direction
    assert tokens.tolist() == (hidden.double() @ weight.double().T).argmax(-1).tolist()


@needs_screen
def test_q8_0_exact_head_packs_without_loss():
    """A head whose rows are 8-bit quants times one fp16 scale per 32 values (GGUF Q8_0)
    packs back to itself: the bound's weight term is zero."""
    gen = torch.Generator().manual_seed(2)
    quants = torch.randint(-127, 128, (64, 96), generator=gen).float()
    quants[:, ::32] = 127.0  # each block reaches +-127, as the GGUF quantizer writes
    scales = (torch.rand(64, 3, generator=gen) * 0.01).half().float()  # fp16, as GGUF's d
    scales = scales.repeat_interleave(32, dim=1)
    weight = quants * scales
    screen = _screen(weight)
    assert float(screen.weights.loss_norms.abs().max()) == 0.0
    hidden = torch.randn(5, 96, generator=gen)
    assert torch.equal(screen.argmax(hidden), _exact_argmax(hidden, weight))


@needs_screen
def test_all_negative_logits_never_pick_padding():
    """The padding rows past the vocabulary (17 -> 32) score 0; with every real logit
    negative they must still never be chosen."""
    weight = -torch.rand(17, 32) - 0.5
    hidden = torch.rand(4, 32) + 0.1
    tokens = _screen(weight).argmax(hidden)
    assert tokens.tolist() == _exact_argmax(hidden, weight).tolist()
    assert int(tokens.max()) < 17


@needs_screen
def test_a_head_that_is_not_finite_gets_no_screen():
    weight = torch.randn(40, 32)
    weight[3, 7] = float("inf")
    assert GreedyScreen.build(fp32_weight(weight), lambda h: h @ weight.T) is None


@needs_screen
def test_rows_that_are_not_finite_take_the_full_logits():
    weight = torch.randn(100, 32)
    hidden = torch.randn(3, 32)
    hidden[1, 5] = float("nan")
    expected = (hidden @ weight.T).argmax(dim=-1)
    assert _screen(weight).argmax(hidden).tolist() == expected.tolist()


@needs_screen
def test_every_token_a_candidate_is_still_exact():
    """39 identical rows tie for the largest logit: all are candidates, each rescored, and
    the lowest id wins (the screen's worst case is the row's fp32 GEMV, not a fallback)."""
    from engine.native.greedy_screen import screen_argmax

    weight = torch.randn(1, 64).repeat(40, 1)
    weight[7] *= 0.5
    hidden = torch.cat([weight[:1] * 3.0, -weight[:1] * 3.0])
    screen = _screen(weight)
    tokens, counts = screen_argmax(screen.weights, screen.head, hidden)
    assert tokens.tolist() == [0, 7]
    assert counts[0] >= 39


@needs_screen
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q6_K, QType.Q4_K, QType.Q4_0])
def test_quantized_heads_rescore_against_their_own_rows(qtype):
    """A head kept in GGUF blocks: the candidates are rescored against its dequantized
    rows (not the 8-bit packing, which only Q8_0 reproduces)."""
    from tests.engine.gguf_files import random_blocks

    data = random_blocks(qtype, 300, 256, 5, 0.01 if qtype == QType.Q8_0 else 0.003)
    head = QuantizedWeight(torch.from_numpy(data.copy()).view(300, -1), qtype, 256)
    weight = head.dequantize()
    screen = GreedyScreen.build(head, lambda h: h @ weight.T)
    assert screen is not None
    hidden = torch.randn(6, 256) * 3
    assert torch.equal(screen.argmax(hidden), _exact_argmax(hidden, weight))


@needs_screen
def test_portable_kernels_have_no_screen():
    from engine.native import greedy_screen, quant

    weight = torch.randn(50, 32)
    screen = _screen(weight)
    quant.set_isa(quant.Isa.PORTABLE)
    try:
        assert not greedy_screen.supported()
        with pytest.raises(greedy_screen.ScreenUnavailable):
            greedy_screen.screen_argmax(screen.weights, screen.head, torch.randn(2, 32))
        assert GreedyScreen.build(fp32_weight(weight), lambda h: h @ weight.T) is None
        # An engine's screen built before the cap falls back to its full logits.
        hidden = torch.randn(2, 32)
        assert screen.argmax(hidden).tolist() == (hidden @ weight.T).argmax(-1).tolist()
    finally:
        quant.set_isa(None)


@needs_screen
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 21, 64])
def test_every_isa_path_gives_the_exact_argmax(rows):
    """Each path the CPU runs (AVX2's 7-bit activations, AVX-512 VNNI's 8-bit), forced in
    turn, over row counts that hit every tile height."""
    from engine.native import greedy_screen, quant

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1500, 96, generator=gen) * 0.05
    hidden = torch.randn(rows, 96, generator=gen)
    hidden[:, 3] *= 30.0
    exact = _exact_argmax(hidden, weight)
    screen = _screen(weight)
    paths = [isa for isa in quant.available_isas() if isa != quant.Isa.PORTABLE]
    try:
        for isa in paths:
            quant.set_isa(isa)
            assert greedy_screen.supported()
            tokens, counts = greedy_screen.screen_argmax(screen.weights, screen.head, hidden)
            assert torch.equal(tokens, exact), isa
            assert bool((counts >= 1).all()), isa
    finally:
        quant.set_isa(None)


@needs_screen
def test_packing_never_dequantizes_the_head_whole():
    """The packing reads the head a few rows at a time: no float tensor it makes is larger
    than its own per-block scales (1/32 of the head's values)."""
    from engine.native.greedy_screen import pack_lm_head
    from tests.engine.gguf_files import random_blocks
    from tests.engine.loader.test_gguf_loading import _LargestFloatTensor

    vocab, hidden = 4096, 256
    data = random_blocks(QType.Q8_0, vocab, hidden, 9, 0.01)
    head = QuantizedWeight(torch.from_numpy(data.copy()).view(vocab, -1), QType.Q8_0, hidden)
    watch = _LargestFloatTensor()
    with watch:
        weights = pack_lm_head(head.dequantize, vocab, hidden)
    assert weights.scales.numel() == vocab * hidden // 32
    assert watch.largest <= weights.scales.numel()


@needs_screen
@pytest.mark.parametrize(("vocab", "hidden_size"), [(49152, 64), (1000, 72), (4099, 576)])
def test_chunking_never_changes_the_packing(vocab, hidden_size):
    """Packed a group (16 rows) at a time, 64 at a time or in the default chunks: the
    same bits (every value of the packing is computed per row)."""
    from engine.native.greedy_screen import pack_chunk_rows, pack_lm_head

    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.15
    weight[::7, 3] *= 50.0  # outliers: blocks whose scale differs from their neighbours'
    width = -(-hidden_size // 32) * 32
    assert pack_chunk_rows(vocab, width) % 16 == 0
    assert pack_chunk_rows(vocab, width) * width <= max(16 * width, vocab * width // 32)
    packed = [
        pack_lm_head(lambda start, end: weight[start:end], vocab, hidden_size, chunk_rows=rows)
        for rows in (None, 16, 64)
    ]
    fields = ("quants", "scales", "loss_norms", "quant_norms", "pad")
    for other in packed[1:]:
        for name in fields:
            assert torch.equal(getattr(packed[0], name), getattr(other, name)), name


@needs_screen
@pytest.mark.parametrize("rows", [0, 8, 24, -16])
def test_pack_chunk_rows_must_be_whole_groups(rows):
    from engine.native.greedy_screen import pack_lm_head

    weight = torch.randn(64, 32)
    with pytest.raises(ValueError, match="chunk_rows"):
        pack_lm_head(lambda start, end: weight[start:end], 64, 32, chunk_rows=rows)
