"""Device-side math for the Triton kernels that `tl` lacks in the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh in fp32 to about an ulp (Cephes' tanhf): an odd polynomial below |x| = 0.625,
    where 1 - 2 / (e^2x + 1) would cancel, that formula above. (libdevice's tanh has no
    interpreter implementation, and the tests run the kernels in the interpreter.)"""
    z = x * x
    small = (
        (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1)
        * z
        - 3.33332819422e-1
    ) * z * x + x
    large = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return tl.where(tl.abs(x) < 0.625, small, large)
