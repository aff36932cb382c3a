"""The per-row Triton kernels the batch-invariant mode keeps unchanged (docs/determinism.md,
"On a GPU"): RMSNorm (with and without the residual add) and SiLU-and-mul compute a row
alone with the bits it gets at any place in a batch (one program per row, block and warps
from the hidden size only)."""

from __future__ import annotations

import torch

from kernels import rms_norm, silu_and_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batches(probe: torch.Tensor, gen: torch.Generator):
    for m in (2, 9, 33):
        batch = torch.randn(m, probe.shape[1], generator=gen).to(DEVICE)
        place = m // 2
        batch[place] = probe[0]
        yield batch, place


def test_rms_norm_rows_are_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, generator=gen).to(DEVICE)
    probe = torch.randn(1, 48, generator=gen).to(DEVICE)
    probe_residual = torch.randn(1, 48, generator=gen).to(DEVICE)
    alone = rms_norm(probe.clone(), weight, 1e-5)
    alone_out, alone_sum = rms_norm(probe.clone(), weight, 1e-5, probe_residual.clone())
    for batch, place in _batches(probe, gen):
        assert torch.equal(rms_norm(batch.clone(), weight, 1e-5)[place], alone[0])
        residual = torch.randn(batch.shape, generator=gen).to(DEVICE)
        residual[place] = probe_residual[0]
        out, summed = rms_norm(batch.clone(), weight, 1e-5, residual)
        assert torch.equal(out[place], alone_out[0]) and torch.equal(summed[place], alone_sum[0])


def test_silu_and_mul_rows_are_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(1)
    probe = torch.randn(1, 64, generator=gen).to(DEVICE)
    alone = silu_and_mul(probe)
    for batch, place in _batches(probe, gen):
        assert torch.equal(silu_and_mul(batch)[place], alone[0])
