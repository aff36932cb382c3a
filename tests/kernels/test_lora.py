"""The Triton LoRA shrink/expand vs. the torch reference (engine.lora.ops): a batch mixing
base-model tokens (-1) and several adapter slots with zero-padded ranks, written into a
column range of a wider output, in fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from engine.lora.ops import add_lora_reference
from kernels.lora import add_lora_triton
from tests.kernels._helpers import device, pick

TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("in_features", "out_features", "max_rank", "num_slots"),
    [(64, 48, 8, 3), (100, 130, 5, 2), pick((96, 64, 16, 4), (4096, 1024, 64, 8))],
)
def test_matches_reference(dtype, in_features, out_features, max_rank, num_slots) -> None:
    gen = torch.Generator().manual_seed(in_features + max_rank)
    num_tokens = pick(19, 1000)
    x = torch.randn(num_tokens, in_features, generator=gen)
    a = torch.randn(num_slots, max_rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(num_slots, out_features, max_rank, generator=gen) / max_rank**0.5
    a[0, max_rank // 2 :] = 0  # slot 0 has a smaller rank, zero-padded
    b[0, :, max_rank // 2 :] = 0
    indices = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    indices[:2] = torch.tensor([-1, num_slots - 1])
    # The output is a column range of a wider tensor, as for q | k | v of a fused projection.
    wide = torch.randn(num_tokens, out_features + 16, generator=gen)
    dev = device()
    x, a, b, indices = (t.to(dev) for t in (x, a, b, indices))
    expected = add_lora_reference(wide.clone().to(dev)[:, 8 : 8 + out_features], x, a, b, indices)
    out = wide.to(dtype).to(dev)
    add_lora_triton(out[:, 8 : 8 + out_features], x.to(dtype), a.to(dtype), b.to(dtype), indices)
    torch.testing.assert_close(out[:, 8 : 8 + out_features].float(), expected, **TOLERANCES[dtype])
    untouched = wide.to(dtype).to(dev)
    torch.testing.assert_close(out[:, :8], untouched[:, :8], atol=0, rtol=0)
    torch.testing.assert_close(out[:, 8 + out_features :], untouched[:, 8 + out_features :])
    base = indices < 0
    torch.testing.assert_close(
        out[base][:, 8 : 8 + out_features], untouched[base][:, 8 : 8 + out_features]
    )


def test_launcher_rejects_bad_layouts() -> None:
    dev = device()
    x = torch.randn(4, 16, device=dev)
    y = torch.zeros(4, 8, device=dev)
    a = torch.randn(2, 4, 16, device=dev)
    b = torch.randn(2, 8, 4, device=dev)
    with pytest.raises(ValueError, match="indices"):
        add_lora_triton(y, x, a, b, torch.zeros(4, device=dev))  # float indices
    with pytest.raises(ValueError, match="b_stacked"):
        add_lora_triton(y, x, a, b[:, :7], torch.zeros(4, dtype=torch.long, device=dev))
    with pytest.raises(ValueError, match="a_stacked must be contiguous"):
        add_lora_triton(
            y,
            x,
            a.transpose(1, 2).contiguous().transpose(1, 2),
            b,
            torch.zeros(4, dtype=torch.long, device=dev),
        )
