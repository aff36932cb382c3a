"""Decode steps of 1..8 requests on the default model: the modules' forward against the
`cpu` backend's whole-step path (engine/attention/cpu_decode_step.py), fp32 and GGUF blocks,
and the fp32 linear methods per weight shape and row bucket (engine/layers/linear_select.py).

    python benchmarks/cpu_paths/decode_step.py                    # both, default sizes
    python benchmarks/cpu_paths/decode_step.py --context 256 --repeats 30
    python benchmarks/cpu_paths/decode_step.py --quant-gemm       # only the quantized GEMM table
    python benchmarks/cpu_paths/decode_step.py --gemv             # only the quantized GEMV table

`--quant-gemm` times, for the default model's projection shapes at 32..2048 activation rows,
the dequantize-GEMM of engine/native/quant_gemm.c on each weight type against the path it
replaced (dequantize the whole weight, then an fp32 matmul) and torch's fp32 GEMMs (MKL
packed, oneDNN, `F.linear`): ms per call and GFLOP/s. `--gemv` times the row kernels of a
decode step (1..8 activation rows, engine/native/quant_kernels.c) on the 32-value block
types and int8, every ISA path this CPU runs alternating call by call, over enough copies of
each weight (64 MB) that it streams from memory as in a step: µs per call and GB/s.

Each figure is the median of `--repeats` steps (ms), the two paths alternating step by
step, so a shared machine's drift hits both alike. Prints the CPU model with every table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root, for tests.engine
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
import torch.nn.functional as F

from engine.api.model_files import default_model_path, load_hf_config
from engine.attention.cpu_backend import CPUAttentionBackend
from engine.layers import linear_select
from engine.layers.method_cache import cache_key
from engine.layers.row_buckets import BUCKET_ROWS
from engine.loader.model_dir import resolve_model
from engine.loader.model_loader import load_model
from engine.native import quant
from engine.worker.inputs import build_step_inputs


def _time(call, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def bench_decode(quantization: str | None, context: int, repeats: int) -> None:
    model_dir = resolve_model(None)
    backend = CPUAttentionBackend()
    model = load_model(
        model_dir,
        load_hf_config(model_dir),
        torch.float32,
        torch.device("cpu"),
        backend,
        quantization=quantization,
        gguf_file=default_model_path() if quantization == "gguf" else None,
    )
    step = backend.whole_step_decode(model)
    config = model.config
    block_size, blocks_per_req = 16, context // 16 + 2
    shape = (2, 8 * blocks_per_req, block_size, config.num_key_value_heads, model.head_dim)
    caches = [torch.zeros(shape) for _ in range(config.num_hidden_layers)]
    print(f"\n{quantization or 'fp32'}: ms per decode step (context {context})")
    print(f"{'rows':>5} {'modules':>9} {'whole-step':>11} {'speed-up':>9}")
    for rows in (1, 2, 4, 8):
        tables = [list(range(r * blocks_per_req, (r + 1) * blocks_per_req)) for r in range(rows)]
        inputs = build_step_inputs([([7], context, t) for t in tables], block_size, "cpu")
        meta = inputs.attn_metadata
        args = (inputs.input_ids, inputs.positions, caches, meta)
        with torch.inference_mode():
            for _ in range(3):
                model(*args), step(*args)
            ours, theirs = [], []
            for _ in range(repeats):
                theirs.append(_time(lambda: model(*args), 1))  # noqa: B023
                ours.append(_time(lambda: step(*args), 1))  # noqa: B023
        a, b = statistics.median(theirs), statistics.median(ours)
        print(f"{rows:>5} {a:>9.2f} {b:>11.2f} {a / b:>8.2f}x")


def bench_linear_methods() -> None:
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M
    methods = tuple(m for m in linear_select.METHODS if linear_select.method_available(m))
    print("\nfp32 linear, µs per call (best of rounds), chosen method per bucket")
    for shape in shapes:
        weight = torch.randn(*shape)
        table = linear_select.time_methods(weight, methods)
        chosen = linear_select.choose_methods(table)
        print(f"{shape[0]}x{shape[1]}")
        for rows, times, pick in zip(BUCKET_ROWS, table, chosen, strict=True):
            cells = "  ".join(f"{m}={t * 1e6:8.1f}" for m, t in times.items())
            print(f"  rows {rows:>4}: {cells}  -> {pick}")


# SmolLM2-135M's projections (out, in): q / o, k / v, the fused q|k|v, gate|up, down.
_GEMM_SHAPES = ((576, 576), (192, 576), (960, 576), (3072, 576), (576, 1536))
_GEMM_ROWS = (32, 64, 128, 2048)
_GEMM_TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q6_K", "INT8", "F32")


def _dequantize_then_mm(x: torch.Tensor, weight: quant.QuantizedWeight) -> torch.Tensor:
    """The path quant_gemm replaced: the weight dequantized 2048 rows at a time, then MKL."""
    out = torch.empty(x.shape[0], weight.out_features)
    for start in range(0, weight.out_features, 2048):
        end = min(start + 2048, weight.out_features)
        out[:, start:end] = x @ weight.dequantize(start, end).t()
    return out


def _gemm_weights(weight: torch.Tensor) -> dict[str, quant.QuantizedWeight]:
    """`weight` in each of _GEMM_TYPES that its width allows (k-quants: 256-multiples)."""
    from tests.engine.gguf_files import random_blocks

    out_features, in_features = weight.shape
    weights = {}
    for name in _GEMM_TYPES:
        if name == "F32":
            weights[name] = quant.fp32_weight(weight)
        elif name == "INT8":
            weights[name] = quant.quantize_int8(weight)
        elif in_features % quant.BLOCK_SIZES[quant.QType[name]][0] == 0:
            qtype = quant.QType[name]
            blocks = random_blocks(qtype, out_features, in_features, seed=0)
            weights[name] = quant.QuantizedWeight(torch.from_numpy(blocks), qtype, in_features)
    return weights


def bench_quant_gemm(repeats: int, stat: str) -> None:
    pick = statistics.median if stat == "median" else min
    print(f"\nquantized GEMM vs fp32 GEMMs: ms per call ({stat}) / GFLOP/s; '-': type needs")
    print("in_features % 256 == 0; 'old' = dequantize whole weight + matmul, on Q8_0")
    names = [f"gemm {t}" for t in _GEMM_TYPES] + ["old", "mkl packed", "onednn", "F.linear"]
    print(f"{'shape':>9} {'rows':>5} " + " ".join(f"{n:>14}" for n in names))
    for out_features, in_features in _GEMM_SHAPES:
        weight = torch.randn(out_features, in_features)
        weights = _gemm_weights(weight)
        for rows in _GEMM_ROWS:
            x = torch.randn(rows, in_features)
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            calls = {
                f"gemm {t}": functools.partial(quant.quant_linear, x, w) for t, w in weights.items()
            }
            calls["old"] = functools.partial(_dequantize_then_mm, x, weights["Q8_0"])
            mkl, onednn = torch.ops.mkl._mkl_linear, torch.ops.mkldnn._linear_pointwise
            calls["mkl packed"] = functools.partial(mkl, x, packed, weight, None, rows)
            calls["onednn"] = functools.partial(onednn, x, reordered, None, "none", [], "")
            calls["F.linear"] = functools.partial(F.linear, x, weight)
            samples: dict[str, list[float]] = {name: [] for name in calls}
            for call in calls.values():
                call()
            for _ in range(repeats):  # interleaved: a stall hits one sample of each method
                for name, call in calls.items():
                    samples[name].append(_time(call, 1))
            flops = 2 * rows * out_features * in_features
            cells = []
            for name in names:
                if name not in samples:
                    cells.append(f"{'-':>14}")
                    continue
                ms = pick(samples[name])
                cells.append(f"{ms:>7.3f}/{flops / ms / 1e6:>6.0f}")
            print(f"{out_features:>4}x{in_features:<4} {rows:>5} " + " ".join(cells), flush=True)


_GEMV_TYPES = ("Q4_1", "Q4_0", "Q8_0", "INT8")


def bench_gemv(repeats: int) -> None:
    from tests.engine.gguf_files import random_blocks

    isas = quant.available_isas()
    print(f"\nquantized GEMV (decode rows): µs per call (median of {repeats}) / GB/s of weights")
    print(f"{'shape':>9} {'type':>5} {'rows':>5} " + " ".join(f"{i.name:>16}" for i in isas))
    for out_features, in_features in _GEMM_SHAPES:
        for name in _GEMV_TYPES:
            if name == "INT8":
                first = quant.quantize_int8(torch.randn(out_features, in_features))
            else:
                qtype = quant.QType[name]
                blocks = random_blocks(qtype, out_features, in_features, seed=0)
                first = quant.QuantizedWeight(torch.from_numpy(blocks), qtype, in_features)
            copies = [first] + [
                quant.QuantizedWeight(first.data.clone(), first.qtype, in_features, first.scales)
                for _ in range(max(0, int(64e6 // first.nbytes) - 1))
            ]
            for rows in (1, 2, 4, 8):
                x = torch.randn(rows, in_features)
                samples: dict[quant.Isa, list[float]] = {isa: [] for isa in isas}
                for i in range(repeats):
                    for isa in isas:
                        quant.set_isa(isa)
                        start = time.perf_counter()
                        quant.quant_linear(x, copies[i % len(copies)])
                        samples[isa].append(time.perf_counter() - start)
                quant.set_isa(None)
                cells = []
                for isa in isas:
                    seconds = statistics.median(samples[isa])
                    cells.append(f"{seconds * 1e6:>9.1f}/{first.nbytes / seconds / 1e9:>6.1f}")
                shape = f"{out_features}x{in_features}"
                print(f"{shape:>9} {name:>5} {rows:>5} " + " ".join(cells), flush=True)


def _cpu_flags() -> str:
    key = cache_key()  # the CPU model and its ISA flags
    return f"{key['cpu']} ({', '.join(key['isa']) or 'no AVX2'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-linear", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads")
    parser.add_argument("--quant-gemm", action="store_true", help="only the quantized GEMM table")
    parser.add_argument(
        "--stat",
        choices=("median", "best"),
        default="median",
        help="--quant-gemm: each method's median or best call (best: on a shared machine)",
    )
    parser.add_argument("--gemv", action="store_true", help="only the quantized GEMV table")
    args = parser.parse_args()
    if args.gemv:
        torch.set_num_threads(args.threads or 2)
        print(f"CPU: {_cpu_flags()}  torch {torch.__version__}  threads {torch.get_num_threads()}")
        bench_gemv(max(args.repeats, 200))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quant_gemm:
        torch.set_num_threads(args.threads or 2)
        print(f"CPU: {_cpu_flags()}  torch {torch.__version__}  threads {torch.get_num_threads()}")
        print(f"quantized kernels' ISA path: {quant.active_isa().name}")
        bench_quant_gemm(args.repeats, args.stat)
        return
    key = cache_key()
    print(
        f"CPU: {key['cpu']}  ISA: {' '.join(key['isa'])}  torch {key['torch']}  "
        f"threads {key['threads']}"
    )
    if not args.skip_linear:
        bench_linear_methods()
    for quantization in (None, "gguf"):
        bench_decode(quantization, args.context, args.repeats)


if __name__ == "__main__":
    main()
