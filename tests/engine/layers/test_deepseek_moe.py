"""DeepSeek-V3's router (engine/layers/deepseek_moe.py): group-limited sigmoid top-k with
the correction bias, against transformers' `DeepseekV3TopkRouter` on the same weights."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from engine.layers.deepseek_moe import GroupedTopK, select_experts_grouped


def test_router_matches_transformers() -> None:
    """Same experts and weights (the order within a token's top-k is free)."""
    for norm, groups, keep, top_k in ((True, 4, 2, 3), (False, 2, 1, 2), (True, 1, 1, 4)):
        config = DeepseekV3Config(
            hidden_size=32, n_routed_experts=16, num_experts_per_tok=top_k, n_group=groups,
            topk_group=keep, norm_topk_prob=norm, routed_scaling_factor=2.5,
        )  # fmt: skip
        torch.manual_seed(groups)
        router = DeepseekV3TopkRouter(config)
        router.weight.data.normal_()
        router.e_score_correction_bias.normal_(0, 0.5)
        x = torch.randn(50, 32)
        _, want_weights, want_ids = router(x)
        logits = torch.nn.functional.linear(x, router.weight)
        weights, ids = select_experts_grouped(
            logits, router.e_score_correction_bias, GroupedTopK.from_config(config)
        )
        order, want_order = ids.sort(-1).indices, want_ids.sort(-1).indices
        assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
        torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
