"""What the sm_90 compile check (tests/kernels/sm90_compile_check.py) builds: every kernel
at the shapes and configurations the engine launches it with, as `CompileCase`s.

    attention_cases       paged attention: dtypes, head sizes, GQA ratios, decode and
                          prefill tiles, split-KV, sliding window, soft-cap, sinks
    flash_prefill_cases   every autotune configuration at Llama-3-8B's shape + layer kinds
    other_cases           the cache writes, RMSNorm, rotary, SiLU-and-mul, MoE, LoRA, ...
    fp8_cache_cases       the cache's readers and writers again over an E4M3 cache
    fp8_gemv_cases        the FP8 GEMV by row bucket, per-tensor, K tails, split reduction

The kernels' modules are imported inside the builders, so that the check decides when the
kernels are decorated (in compile mode, never under TRITON_INTERPRET).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class CompileCase:
    label: str
    kernel: Any  # a triton.JITFunction
    arg_types: dict[str, str]  # non-constexpr arguments that are not plain i32
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 1


def attention_cases() -> list[CompileCase]:
    attention = importlib.import_module("kernels.paged_attention")
    cases = []
    # (dtype, head_dim, queries per KV head, max query len, splits, sliding window, soft cap,
    # attention sinks)
    for dtype, head_dim, queries_per_kv, max_query_len, num_splits, window, soft_cap, sinks in [
        (torch.bfloat16, 128, 4, 1, 1, 0, False, False),  # Llama-3-8B decode
        (torch.bfloat16, 128, 4, 1, 4, 0, False, False),  # split-KV decode
        (torch.bfloat16, 128, 4, 512, 1, 0, False, False),  # prefill
        (torch.float16, 64, 3, 512, 1, 0, False, False),  # SmolLM2-135M prefill
        (torch.float32, 128, 4, 512, 1, 0, False, False),
        (torch.bfloat16, 256, 8, 1, 1, 0, False, False),
        (torch.bfloat16, 96, 1, 512, 1, 0, False, False),
        (torch.bfloat16, 256, 2, 1, 1, 4096, True, False),  # Gemma-2-9B local layer, decode
        (torch.bfloat16, 256, 2, 512, 1, 4096, True, False),  # ... prefill
        (torch.bfloat16, 64, 8, 1, 1, 128, False, True),  # GPT-OSS-120B sliding layer, decode
        (torch.bfloat16, 64, 8, 1, 4, 0, False, True),  # ... full layer, split-KV decode
        (torch.bfloat16, 64, 8, 512, 1, 0, False, True),  # ... full layer, prefill
    ]:
        tiles = attention._tile_config(queries_per_kv, head_dim, max_query_len, dtype)
        name = TRITON_TYPES[dtype]
        arg_types = {
            "query_ptr": f"*{name}",
            "key_cache_ptr": f"*{name}",
            "value_cache_ptr": f"*{name}",
            "out_ptr": f"*{name}",
            "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "query_start_loc_ptr": "*i32",
            "partial_out_ptr": "*fp32",
            "partial_lse_ptr": "*fp32",
            "scale_log2": "fp32",
            "soft_cap_log2": "fp32",
            "sinks_ptr": "*bf16",
        }
        constexprs = {
            "NUM_HEADS": 32,
            "QUERIES_PER_KV": queries_per_kv,
            "GROUP": tiles.group,
            "BLOCK_Q": tiles.block_q,
            "BLOCK_N": tiles.block_n,
            "BLOCK_SIZE": 16,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PADDED": tiles.head_dim_padded,
            "NUM_SPLITS": num_splits,
            "SLIDING_WINDOW": window,
            "HAS_SOFT_CAP": soft_cap,
            "HAS_SINKS": sinks,
            "UPCAST": False,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else None,
        }
        label = f"paged_attention {name} d={head_dim} qpk={queries_per_kv} q={max_query_len}"
        label += f" splits={num_splits} window={window} soft_cap={soft_cap} sinks={sinks}"
        cases.append(
            CompileCase(
                label,
                attention._paged_attention_kernel,
                arg_types,
                constexprs,
                tiles.num_warps,
                tiles.num_stages,
            )
        )
    return cases


def flash_prefill_cases() -> list[CompileCase]:
    """Every autotune configuration at Llama-3-8B's shape, and the first (largest) one the
    pruning keeps for the other layer kinds. Not fp32: its FMA dots spill 80 bytes a thread
    at head_dim 128 in the smallest tile (kernels/flash_prefill.py, `_configs`)."""
    flash = importlib.import_module("kernels.flash_prefill")
    cases = []
    # (dtype, head_dim, queries per KV head, sliding window, soft cap, sinks, all configs)
    for dtype, head_dim, queries_per_kv, window, soft_cap, sinks, every in [
        (torch.bfloat16, 128, 4, 0, False, False, True),  # Llama-3-8B
        (torch.float16, 64, 3, 0, False, False, False),  # SmolLM2-135M
        (torch.bfloat16, 256, 2, 4096, True, False, False),  # Gemma-2-9B local layer
        (torch.bfloat16, 64, 8, 128, False, True, False),  # GPT-OSS-120B sliding layer
    ]:
        name = TRITON_TYPES[dtype]
        arg_types = {
            "query_ptr": f"*{name}",
            "key_cache_ptr": f"*{name}",
            "value_cache_ptr": f"*{name}",
            "out_ptr": f"*{name}",
            "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "query_start_loc_ptr": "*i32",
            "scale_log2": "fp32",
            "soft_cap_log2": "fp32",
            "sinks_ptr": "*bf16",
        }
        configs = flash.prune_configs(flash._configs(), head_dim, dtype.itemsize)
        for config in configs if every else configs[:1]:
            constexprs = {
                "QUERIES_PER_KV": queries_per_kv,
                "BLOCK_SIZE": 16,
                "HEAD_DIM": head_dim,
                "HEAD_DIM_PADDED": max(16, head_dim),
                "SLIDING_WINDOW": window,
                "HAS_SOFT_CAP": soft_cap,
                "HAS_SINKS": sinks,
                "UPCAST": False,
                "DOT_PRECISION": "ieee" if dtype == torch.float32 else None,
                **config.kwargs,
            }
            label = f"flash_prefill {name} d={head_dim} qpk={queries_per_kv} window={window}"
            label += f" soft_cap={soft_cap} sinks={sinks} {config}"
            kernel = flash._flash_prefill_kernel.fn
            cases.append(
                CompileCase(
                    label, kernel, arg_types, constexprs, config.num_warps, config.num_stages
                )
            )
    return cases


def other_cases() -> list[CompileCase]:
    split_kv = importlib.import_module("kernels.split_kv")
    kv_cache = importlib.import_module("kernels.kv_cache")
    rms_norm = importlib.import_module("kernels.rms_norm")
    rotary = importlib.import_module("kernels.rotary")
    rotary_kv = importlib.import_module("kernels.rotary_kv")
    activation = importlib.import_module("kernels.activation")
    fp8_quant = importlib.import_module("kernels.fp8_quant")
    bf16 = "*bf16"
    return [
        CompileCase(
            "quantize_per_token_fp8",
            fp8_quant._quantize_per_token_kernel,
            {"x_ptr": bf16, "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
            {"BLOCK": 1024},
        ),
        CompileCase(
            "merge_splits",
            split_kv._merge_splits_kernel,
            {
                "partial_out_ptr": "*fp32",
                "partial_lse_ptr": "*fp32",
                "query_start_loc_ptr": "*i32",
                "out_ptr": bf16,
            },
            {
                "NUM_HEADS": 32,
                "NUM_SPLITS": 5,
                "SPLITS_PADDED": 8,
                "HEAD_DIM": 128,
                "HEAD_DIM_PADDED": 128,
            },
        ),
        CompileCase(
            "write_kv_cache",
            kv_cache._write_kv_cache_kernel,
            {
                "key_ptr": bf16,
                "value_ptr": bf16,
                "key_cache_ptr": bf16,
                "value_cache_ptr": bf16,
                "slot_mapping_ptr": "*i64",
            },
            {
                "NUM_KV_HEADS": 8,
                "HEADS_PADDED": 8,
                "HEAD_DIM": 128,
                "HEAD_DIM_PADDED": 128,
                "BLOCK_SIZE": 16,
            },
        ),
        CompileCase(
            "rms_norm+residual",
            rms_norm._rms_norm_kernel,
            {
                "x_ptr": bf16,
                "residual_ptr": bf16,
                "weight_ptr": bf16,
                "out_ptr": bf16,
                "new_residual_ptr": bf16,
                "eps": "fp32",
            },
            {"HIDDEN": 4096, "BLOCK": 4096, "HAS_RESIDUAL": True},
            num_warps=8,
        ),
        CompileCase(
            "apply_rotary",
            rotary._rotary_kernel,
            {
                "positions_ptr": "*i64",
                "query_ptr": bf16,
                "key_ptr": bf16,
                "cos_sin_cache_ptr": "*fp32",
            },
            {
                "NUM_HEADS": 32,
                "NUM_KV_HEADS": 8,
                "HEADS_PADDED": 32,
                "KV_HEADS_PADDED": 8,
                "HALF": 64,
                "HALF_PADDED": 64,
            },
        ),
        CompileCase(
            "rotary_write_kv_cache",
            rotary_kv._rotary_kv_kernel,
            {
                "qk_ptr": bf16,
                "cos_ptr": bf16,
                "sin_ptr": bf16,
                "value_ptr": bf16,
                "key_cache_ptr": bf16,
                "value_cache_ptr": bf16,
                "slot_mapping_ptr": "*i64",
            },
            {
                "NUM_HEADS": 32,
                "NUM_KV_HEADS": 8,
                "HEADS_PADDED": 32,
                "KV_HEADS_PADDED": 8,
                "HALF": 64,
                "HALF_PADDED": 64,
                "BLOCK_SIZE": 16,
                "WRITE_KV": True,
            },
        ),
        CompileCase(
            "silu_and_mul",
            activation._silu_and_mul_kernel,
            {"x_ptr": bf16, "out_ptr": bf16},
            {"INTERMEDIATE": 14336, "BLOCK": 1024},
        ),
    ]


def fp8_gemv_cases() -> list[CompileCase]:
    """The FP8 GEMV in every configuration its autotuner can pick, per row bucket (one row:
    all; 16 rows: the dot tiles, splits included; 32 and 64 rows: the unsplit dot tiles),
    bf16 activations, per-channel scales, K a multiple of the step (as the served shapes);
    the first dot tile with a per-tensor scale, the first dot and FMA tiles with a K tail;
    and the split reduction. Not fp32 activations (a test-only dtype on a GPU): its `ieee`
    dots spill ~300 bytes a thread in the 16-row tile, as flash_prefill's do."""
    gemv = importlib.import_module("kernels.fp8_gemv")
    arg_types = {
        "x_ptr": "*bf16",
        "w_ptr": "*fp8e4nv",
        "scale_ptr": "*fp32",
        "out_ptr": "*bf16",
        "partial_ptr": "*fp32",
    }
    cases = []
    for bucket in (1, 16, 32, 64):
        for config in gemv.GPU_CONFIGS:
            if not gemv.config_fits(config, bucket) or (config.split_k > 1 and bucket > 16):
                continue
            constexprs = {
                "M_BUCKET": bucket,
                "PER_CHANNEL": True,
                "DOT_PRECISION": None,
                "EVEN_K": True,  # the 8B shapes' K in every config
                **config.triton().kwargs,
            }
            cases.append(
                CompileCase(
                    f"fp8_gemv rows<={bucket} {config}",
                    gemv._fp8_gemv_kernel,
                    arg_types,
                    constexprs,
                    config.num_warps,
                    config.num_stages,
                )
            )
    first_dot = next(c for c in gemv.GPU_CONFIGS if c.dot)
    for per_channel, even_k in ((False, True), (True, False)):
        constexprs = {
            "M_BUCKET": 16,
            "PER_CHANNEL": per_channel,
            "DOT_PRECISION": None,
            "EVEN_K": even_k,
            **first_dot.triton().kwargs,
        }
        variant = "per-tensor" if not per_channel else "K tail"
        cases.append(
            CompileCase(
                f"fp8_gemv rows<=16 {variant} {first_dot}",
                gemv._fp8_gemv_kernel,
                arg_types,
                constexprs,
                first_dot.num_warps,
                first_dot.num_stages,
            )
        )
    first_fma = next(c for c in gemv.GPU_CONFIGS if not c.dot)
    cases.append(
        CompileCase(
            f"fp8_gemv rows<=1 K tail {first_fma}",
            gemv._fp8_gemv_kernel,
            arg_types,
            {
                "M_BUCKET": 1,
                "PER_CHANNEL": True,
                "DOT_PRECISION": None,
                "EVEN_K": False,
                **first_fma.triton().kwargs,
            },
            first_fma.num_warps,
            first_fma.num_stages,
        )
    )
    cases.append(
        CompileCase(
            "fp8_gemv sum_splits",
            gemv._sum_splits_kernel,
            {"partial_ptr": "*fp32", "out_ptr": "*bf16"},
            {"SPLIT_K": 2, "BLOCK": 1024},
        )
    )
    return cases


def fp8_cache_cases(cases: list[CompileCase]) -> list[CompileCase]:
    """The kernels that write or read the KV cache once more over an E4M3 cache
    (`kv_cache_dtype="fp8"`): Llama-3-8B's decode and prefill attention, the first flash-prefill
    configuration, and both cache writes."""
    wanted = (
        "paged_attention bf16 d=128 qpk=4 q=1 splits=1 ",
        "paged_attention bf16 d=128 qpk=4 q=512 ",
        "write_kv_cache",
        "rotary_write_kv_cache",
    )
    picked = [case for case in cases if case.label.startswith(wanted)]
    picked += [case for case in cases if case.label.startswith("flash_prefill bf16 d=128")][:1]
    fp8 = []
    for case in picked:
        arg_types = {
            name: "*fp8e4nv" if name in ("key_cache_ptr", "value_cache_ptr") else kind
            for name, kind in case.arg_types.items()
        }
        constexprs = {**case.constexprs, "IS_FP8": True, "SCALE_IS_PTR": False}
        fp8.append(
            CompileCase(
                f"{case.label} [fp8 cache]",
                case.kernel,
                arg_types,
                constexprs,
                case.num_warps,
                case.num_stages,
            )
        )
    return fp8
