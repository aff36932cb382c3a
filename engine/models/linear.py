"""Linear layers whose fp32 CPU GEMMs run on MKL-prepacked weights.

A plain fp32 `F.linear` on CPU calls MKL's sgemm, which re-packs the whole weight matrix
into its blocked kernel layout on every call. For the skinny activations of a decode step
(a few to a few hundred rows against a 576 x 3072 weight) that repacking is a large share
of the call: on a 2-core AVX-512 machine a [64, 576] x [576, 3072] product runs at
~115 GFLOP/s unpacked and ~185 GFLOP/s packed (`benchmarks/kernels_cpu.py` measures this).
`pack_linear_weights` packs every weight once at load time (`cblas_sgemm_pack` through
`torch.ops.mkl`, the path Inductor's CPU freezing uses) and `linear` calls
`cblas_sgemm_compute` on the packed copy.

The packed copy is as large as the weight; the original is kept for everything else
(embedding lookups with tied weights, other devices, the fallback). The packed layout of
the weight does not depend on the row count of the activation it is used with (checked by
`_packing_is_exact` at start-up for several row counts, and by the tests), so one packed
copy serves every batch size: the op's `prepack_batch_size` argument is passed the actual
row count, which is what makes it take the packed path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def packing_available() -> bool:
    """Whether this torch build has MKL's packed fp32 GEMM ops."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def linear(
    x: torch.Tensor,  # [..., in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,  # MKL-packed `weight`, or None
) -> torch.Tensor:  # [..., out_features]
    """`F.linear`, on the packed weight when there is one (also at one row: batch-1 decode
    measured ≈4 % faster packed than through MKL's GEMV)."""
    if packed is None or x.dim() != 2 or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` with an optional MKL-packed copy of its weight (see the module doc).

    `output_sizes` names the row blocks of a fused projection (q | k | v, gate | up), in
    checkpoint order: the generic loader fills shard i at rows sum(output_sizes[:i]).
    """

    packed_weight: torch.Tensor | None = None
    # Set for quantized weights (engine/models/quantization.py): computes the layer instead.
    quant_method: Any = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        output_sizes: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if output_sizes is not None and sum(output_sizes) != out_features:
            raise ValueError(f"output_sizes {output_sizes} do not add up to {out_features}.")
        self.output_sizes = output_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(x, self.bias)
        return linear(x, self.weight, self.bias, self.packed_weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The MKL-packed copy of an fp32 CPU weight [out_features, in_features]."""
    # The batch-size hint does not change the packed layout (see the module doc).
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), 64)


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and packing_available()
    )


def pack_linear_weights(model: nn.Module) -> int:
    """Packs the weight of every `Linear` in `model` that can be packed; returns how many.

    Does nothing (and returns 0) off CPU, for other dtypes, on torch builds without MKL,
    or when the start-up check finds the packed product differs from `F.linear`.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear) and can_pack(m.weight)]
    if not layers or not _packing_is_exact(layers[0].weight):
        return 0
    with torch.no_grad():
        for layer in layers:
            layer.packed_weight = pack_weight(layer.weight)
    return len(layers)


def _packing_is_exact(weight: torch.Tensor) -> bool:
    """Checks, on one real weight, that packed products match `F.linear` for several row
    counts (including ones other than the packing hint) up to fp32 rounding."""
    try:
        packed = pack_weight(weight)
        generator = torch.Generator().manual_seed(0)
        for rows in (2, 3, 17, 64, 129):
            x = torch.randn(rows, weight.shape[1], generator=generator)
            expected = F.linear(x, weight)
            actual = torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
            tolerance = 1e-4 * (expected.abs().max().item() + 1.0)
            if (actual - expected).abs().max().item() > tolerance:
                logger.warning("MKL packed GEMM disagrees with F.linear; not using it.")
                return False
    except RuntimeError as error:  # an MKL-less or otherwise limited build
        logger.warning("MKL packed GEMM unavailable (%s); using F.linear.", error)
        return False
    return True
