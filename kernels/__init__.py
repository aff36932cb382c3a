"""Triton kernels with their launchers and pure-torch references: the GPU's kernels.

Launchers validate dtypes, devices and layouts on the host and raise `ValueError` for
anything they do not support; see docs/kernels.md for layouts and blocking.

Why two kernel homes: this top-level package holds what runs on a GPU (Triton; DESIGN.md
fixes it as a top-level folder that imports only torch and triton, testable in Triton's
interpreter), while the CPU's kernels are C built at run time for the machine's instruction
set and called through ctypes (engine/native/), because they are part of how the engine runs
on CPUs (whole-step decode, quantized GEMMs, the greedy screen) rather than a kernel library.
"""

from kernels.activation import silu_and_mul
from kernels.flash_prefill import flash_prefill
from kernels.kv_cache import write_kv_cache
from kernels.paged_attention import paged_attention
from kernels.reference import (
    ref_paged_attention,
    ref_rms_norm,
    ref_rotary,
    ref_rotary_cos_sin,
    ref_silu_and_mul,
    ref_write_kv_cache,
)
from kernels.rms_norm import rms_norm
from kernels.rotary import apply_rotary, build_cos_sin_cache
from kernels.rotary_kv import rotary_cos_sin_, rotary_write_kv_cache

__all__ = [
    "apply_rotary",
    "build_cos_sin_cache",
    "flash_prefill",
    "paged_attention",
    "ref_paged_attention",
    "ref_rms_norm",
    "ref_rotary",
    "ref_rotary_cos_sin",
    "ref_silu_and_mul",
    "ref_write_kv_cache",
    "rms_norm",
    "rotary_cos_sin_",
    "rotary_write_kv_cache",
    "silu_and_mul",
    "write_kv_cache",
]
