"""`dtype="auto"` on a CPU: bf16 where the CPU computes it natively (AMX-BF16, AVX512-BF16),
fp32 elsewhere, decided from the CPU's flags at run time (engine/config/cpu_dtype.py); GGUF
blocks kept quantized compute in fp32 and keep the engine in fp32."""

from __future__ import annotations

import pytest

from engine import EngineArgs
from engine.config.cpu_dtype import NATIVE_BF16_FLAGS, cpu_auto_dtype, cpu_flags, native_bf16
from tests.model_utils import make_tiny_llama

SKYLAKE_SP = [
    "fpu",
    "sse2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
]
SAPPHIRE_RAPIDS = [*SKYLAKE_SP, "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"]
ZEN4 = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"]
ZEN3 = ["avx2", "fma", "sse4_2"]


@pytest.mark.parametrize(
    "flags,expected",
    [
        (SKYLAKE_SP, "float32"),  # AVX-512 with VNNI, no bf16 (this task's machine)
        (ZEN3, "float32"),
        ([], "float32"),  # unreadable /proc/cpuinfo, or not x86
        (SAPPHIRE_RAPIDS, "bfloat16"),
        (ZEN4, "bfloat16"),  # AVX512-BF16 without AMX
        ([*SKYLAKE_SP, "amx_bf16"], "bfloat16"),  # AMX alone suffices
    ],
)
def test_flags_pick_the_dtype(flags, expected):
    assert cpu_auto_dtype(flags, environ={}) == expected


def test_an_isa_cap_below_bf16_means_fp32():
    """--emulate-isa avx2 caps oneDNN: the machine then resolves as an AVX2 one would."""
    assert cpu_auto_dtype(SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "float32"
    assert cpu_auto_dtype(SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}) == (
        "float32"
    )
    assert cpu_auto_dtype(SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == (
        "bfloat16"
    )
    assert cpu_auto_dtype(ZEN4, {"ONEDNN_MAX_CPU_ISA": "ALL"}) == "bfloat16"


def test_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_this_machine_resolves_from_its_own_flags(tmp_path, monkeypatch):
    """The engine's resolved dtype follows this machine's flags (fp32 on an AVX-512 Xeon
    without AVX512-BF16/AMX, bf16 on Sapphire Rapids or Zen 4)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    flags = cpu_flags()
    expected = "bfloat16" if set(flags) & set(NATIVE_BF16_FLAGS) else "float32"
    assert native_bf16(flags) == (expected == "bfloat16")
    model = make_tiny_llama(tmp_path / "m")
    config = EngineArgs(model=str(model), device="cpu").create_engine_config()
    assert config.model_config.dtype == expected
    assert config.model_config.quantization is None
    explicit = EngineArgs(model=str(model), device="cpu", dtype="float32").create_engine_config()
    assert explicit.model_config.dtype == "float32"


def test_the_default_gguf_model_stays_fp32_with_its_blocks(monkeypatch):
    """The default model's GGUF blocks compute in fp32 (quantized kernels, greedy screen):
    `auto` keeps fp32 for them on every CPU; without quantization it follows the flags."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    config = EngineArgs(device="cpu").create_engine_config()
    if config.model_config.quantization is None:
        pytest.skip("the default GGUF model's blocks cannot be kept quantized here")
    assert config.model_config.dtype == "float32"
    plain = EngineArgs(device="cpu", quantization=None).create_engine_config()
    assert plain.model_config.dtype == cpu_auto_dtype(cpu_flags())
