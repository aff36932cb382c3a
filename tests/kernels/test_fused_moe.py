"""The MoE grouped GEMM (one call per projection over rows sorted by expert): the Triton
kernel (on CUDA tensors on a GPU, in the interpreter on CPU tensors without one) and the
native C kernel against the torch reference (on the CPU), and the whole expert computation
of each against transformers' per-expert loop."""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe import (
    moe_experts,
    select_experts,
    sort_rows,
    torch_grouped_gemm,
)
from engine.layers.ops import silu_and_mul
from kernels.reference import ref_moe_experts
from tests.kernels._helpers import device
from tests.triton_utils import import_triton


def _on(impl, *tensors):
    """The tensors where `impl` runs: the Triton kernels' device (CUDA when present), the
    CPU for the native kernel and the torch reference."""
    target = device() if impl == "triton" else torch.device("cpu")
    return [None if t is None else t.to(target) for t in tensors]


def _problem(num_tokens, num_experts, top_k, n, k, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    w = (torch.randn(num_experts, n, k, generator=gen) / k**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w, sort_rows(weights, ids, num_experts)


def _grouped(name):
    if name == "triton":
        import_triton()
        from kernels.fused_moe import moe_grouped_gemm

        return moe_grouped_gemm
    from engine.layers.moe import grouped_gemm_impl

    return grouped_gemm_impl("native")


# (tokens, experts, top_k, n, k): decode-sized and prefill-sized batches, experts left
# without rows (3 tokens x top-2 over 8 experts), k and n off every block size.
SHAPES = [(3, 8, 2, 40, 32), (37, 4, 2, 96, 64), (64, 8, 2, 33, 72), (1, 5, 3, 16, 17)]


@pytest.mark.parametrize("impl", ["native", "triton"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_grouped_gemm_matches_the_reference(impl, shape):
    x, w, rows = _problem(*shape)
    expected = torch_grouped_gemm(x, rows.token, w, rows.offsets)
    got = _grouped(impl)(*_on(impl, x, rows.token, w), rows.offsets)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=1e-5)
    # Without a row map, output row i reads x row i (the down projection's case).
    flat = x[rows.token]
    flat_on, w_on = _on(impl, flat, w)
    torch.testing.assert_close(
        _grouped(impl)(flat_on, None, w_on, rows.offsets).cpu(),
        torch_grouped_gemm(flat, None, w, rows.offsets),
        atol=2e-5,
        rtol=1e-5,
    )


def test_triton_grouped_gemm_fp16():
    import_triton()
    from kernels.fused_moe import moe_grouped_gemm

    x, w, rows = _problem(20, 4, 2, 48, 64, dtype=torch.float16)
    expected = torch_grouped_gemm(x.float(), rows.token, w.float(), rows.offsets)
    got = moe_grouped_gemm(*_on("triton", x, rows.token, w), rows.offsets)
    torch.testing.assert_close(got.float().cpu(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("impl", ["torch", "native", "triton"])
def test_experts_match_transformers_per_expert_loop(impl):
    num_tokens, num_experts, top_k, hidden, inter = 29, 6, 2, 32, 48
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, False)
    gemm = torch_grouped_gemm if impl == "torch" else _grouped(impl)
    got = moe_experts(*_on(impl, x, w13, w2, weights, ids), gemm, silu_and_mul)
    expected = ref_moe_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_routing_matches_transformers_routers():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(11, 16)
    for router, renormalize in (
        (MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8)), True),
        (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8)), False),
        (
            Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, norm_topk_prob=True)),
            True,
        ),
    ):
        torch.nn.init.normal_(router.weight)
        logits, expected_weights, expected_ids = router(x)
        weights, ids = select_experts(logits, router.top_k, renormalize)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights)


def test_grouped_gemm_rejects_bad_inputs():
    from engine.native import moe_grouped_gemm

    x, w, rows = _problem(4, 3, 2, 8, 16)
    offsets = torch.tensor(rows.offsets)
    with pytest.raises(ValueError, match="k=16"):
        moe_grouped_gemm(x[:, :8], rows.token, w, offsets)
    with pytest.raises(ValueError, match="offsets"):
        moe_grouped_gemm(x, rows.token, w, offsets[:-1])
    with pytest.raises(ValueError, match="rows"):
        moe_grouped_gemm(x, rows.token[:3], w, offsets)
