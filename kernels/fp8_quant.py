"""Per-token FP8 (E4M3) quantization of activations in one kernel: the input of an FP8 GEMM.

    scale[t] = max(amax(|x[t, :]|) / 448, 1 / (448 * 512))
    q[t, k]  = round_to_e4m3(clamp(x[t, k] / scale[t], -448, 448))

Written as torch ops (engine/layers/fp8_linear.py: `quantize_per_token`) this is about
seven kernels with fp32 temporaries; on an H200 in CUDA graphs they took 15 us at one row
and 450 us at 2048 x 14336, as long as the FP8 GEMM they feed (docs/benchmarks.md). Here
each row is read twice (amax, then quantize; a row of <= 16k bf16 values stays in L2) and
written once as FP8.

The rounding to E4M3 is done in fp32 before the cast, to nearest with ties to even, so the
cast is exact: Triton's interpreter mis-rounds FP8 casts that carry into the next binade
(125.1 became 64, not 128), and the value is then torch's own `.to(float8_e4m3fn)` of
x / scale bit for bit on every backend. Both divisions are IEEE (`div_rn`); torch on CUDA
divides amax by 448 as a multiply by the reciprocal, so its scale can differ by one ulp.
The step of the value's binade is 2^(exponent - 3) (3 mantissa bits),
2^-9 below the smallest normal 2^-6; `t / step` is at most 16, so adding and subtracting
1.5 * 2^23 rounds it to an integer the way the FPU rounds (ties to even).

Grid: one program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_contiguous, check_dtype, check_ndim, check_same_device

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # a row of zeros: no division by zero, the row stays 0
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23 (constexpr: a jit function may read it)
BLOCK_K = 1024


@triton.jit
def round_to_e4m3(v):  # fp32, |v| <= 448 -> fp32 on the E4M3 grid (ties to even)
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    exponent = tl.maximum(exponent, -6)  # subnormals share the step of the smallest binade
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
    inv_step = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)  # 1 / step, exact
    t = a * inv_step  # exact: a power of two
    t = (t + _ROUND_MAGIC) - _ROUND_MAGIC
    r = t * step
    negative = v.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 stays -0.0, as in torch
    return tl.where(negative, -r, r)


@triton.jit
def quantize_e4m3(x, scale):  # any float, fp32 scale -> fp32 on the E4M3 grid (an FP8 KV cache)
    return round_to_e4m3(tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0))


@triton.jit
def kv_scale_value(scale, SCALE_IS_PTR: tl.constexpr):  # a float, or a 1-element tensor's
    value = scale
    if SCALE_IS_PTR:
        value = tl.load(scale).to(tl.float32)
    return value


@triton.jit
def kv_scale_values(k_scale, v_scale, IS_FP8: tl.constexpr, SCALE_IS_PTR: tl.constexpr):
    """An FP8 cache's (keys', values') scales in fp32; 1.0 each, never read, otherwise."""
    ks = 1.0
    vs = 1.0
    if IS_FP8:
        ks = kv_scale_value(k_scale, SCALE_IS_PTR)
        vs = kv_scale_value(v_scale, SCALE_IS_PTR)
    return ks, vs


@triton.jit
def _quantize_per_token_kernel(
    x_ptr,  # [num_tokens, K] bf16 / fp16 / fp32
    q_ptr,  # [num_tokens, K] float8_e4m3fn
    scale_ptr,  # [num_tokens] fp32
    K,  # int
    BLOCK: tl.constexpr,  # int, a power of two
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        mask = start + offsets < K
        x = tl.load(x_ptr + row * K + start + offsets, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # IEEE divisions (div_rn): Triton's `/` on fp32 is the GPU's approximate division, which
    # would round some values differently from torch.
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), 1.0 / (448.0 * 512.0))
    for start in range(0, K, BLOCK):
        mask = start + offsets < K
        x = tl.load(x_ptr + row * K + start + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        q = round_to_e4m3(v)
        tl.store(q_ptr + row * K + start + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token_fp8(
    x: torch.Tensor,  # [num_tokens, K], contiguous
) -> tuple[torch.Tensor, torch.Tensor]:  # float8_e4m3fn [num_tokens, K], fp32 [num_tokens, 1]
    check_dtype("x", x, (torch.float32, torch.float16, torch.bfloat16))
    check_ndim("x", x, 2, "[num_tokens, K]")
    check_contiguous("x", x)
    num_tokens, k = x.shape
    q = torch.empty(num_tokens, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    check_same_device(x=x, q=q, scale=scale)
    if num_tokens == 0:
        return q, scale
    block = min(BLOCK_K, triton.next_power_of_2(k))
    _quantize_per_token_kernel[(num_tokens,)](x_ptr=x, q_ptr=q, scale_ptr=scale, K=k, BLOCK=block)
    return q, scale


def ref_quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pure-torch reference (the same formula, torch's own FP8 cast)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
