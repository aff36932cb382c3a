"""The ops a model binds on CUDA with the Triton backend, run where the tests run.

`select_op_impl` gives "triton" only for the triton backend on a CUDA device, so the CPU
suite never built a model whose RMSNorm and SiLU-and-mul call the Triton kernels through
the op modules. Here the modules are built with that choice and run on the Triton kernels'
device (CUDA when present, CPU tensors in the interpreter otherwise) against the torch ops:
the binding, the residual form and the argument order are the ones the GPU path uses.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.ops import RMSNorm, SiluAndMul, select_op_impl
from tests.kernels._helpers import device

pytest.importorskip("triton")


def test_the_op_choice_table() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert select_op_impl("triton", cuda, torch.bfloat16) == "triton"
    assert select_op_impl("triton", cpu, torch.float32) == "torch"  # the interpreter's case
    assert select_op_impl("torch", cuda, torch.float16) == "torch"
    assert select_op_impl("cpu", cpu, torch.bfloat16) == "torch"  # native is fp32 only


def test_triton_bound_ops_match_torch() -> None:
    dev = device()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 48, generator=gen).to(dev)
    residual = torch.randn(7, 48, generator=gen).to(dev)
    triton_norm, torch_norm = RMSNorm(48, 1e-5, impl="triton"), RMSNorm(48, 1e-5)
    with torch.no_grad():
        weight = torch.rand(48, generator=gen) + 0.5
        triton_norm.weight.copy_(weight)
        torch_norm.weight.copy_(weight)
    triton_norm, torch_norm = triton_norm.to(dev), torch_norm.to(dev)
    torch.testing.assert_close(triton_norm(x), torch_norm(x), atol=1e-5, rtol=1e-5)
    got_out, got_sum = triton_norm(x.clone(), residual.clone())
    want_out, want_sum = torch_norm(x.clone(), residual.clone())
    torch.testing.assert_close(got_sum, want_sum, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(7, 2 * 40, generator=gen).to(dev)
    torch.testing.assert_close(
        SiluAndMul("triton")(gate_up), SiluAndMul()(gate_up), atol=1e-5, rtol=1e-5
    )
