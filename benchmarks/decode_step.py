"""Decode steps of 1..8 requests on the default model: the modules' forward against the
`cpu` backend's whole-step path (engine/attention/cpu_decode_step.py), fp32 and GGUF blocks,
and the fp32 linear methods per weight shape and row bucket (engine/models/linear_select.py).

    python benchmarks/decode_step.py                    # both, default sizes
    python benchmarks/decode_step.py --context 256 --repeats 30

Each figure is the median of `--repeats` steps (ms), the two paths alternating step by
step, so a shared machine's drift hits both alike. Prints the CPU model with every table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.attention.cpu_backend import CPUAttentionBackend
from engine.models import linear_select
from engine.models.loader import default_model_path, load_hf_config, load_model, resolve_model
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
        for rows, times, pick in zip(linear_select._BUCKET_ROWS, table, chosen, strict=True):
            cells = "  ".join(f"{m}={t * 1e6:8.1f}" for m, t in times.items())
            print(f"  rows {rows:>4}: {cells}  -> {pick}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-linear", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    key = linear_select.cache_key()
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
