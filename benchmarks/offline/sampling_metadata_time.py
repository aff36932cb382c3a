"""The host's time to make one decode step's sampling tensors: rebuilt from the rows
(`SamplingMetadata.build`) against gathered from the per-slot state
(engine/sample/sampling_slots.py, with its `advance`).

    python benchmarks/offline/sampling_metadata_time.py              # batch 1, 64, 256
    python benchmarks/offline/sampling_metadata_time.py --penalties  # repetition 1.2 too
    python benchmarks/offline/sampling_metadata_time.py --penalties --penalties-on-device

`B` seeded rows (temperature 0.8, top_p 0.9, a seed each), a vocabulary of `--vocab-size`,
the CPU. `--penalties` adds a repetition penalty: on the CPU built from the rows' tokens each
step, as the rebuild does; with `--penalties-on-device` counted on the device as on a GPU
(the [B, V] gather included). Each way runs `--steps` steps per measurement, alternating,
`--repeats` times; reported: the median (min..max) of the process CPU microseconds per step
(the machine may be shared). Both ways build what the runner builds per step, the rows'
tuples included; the rebuild's `torch.tensor` calls would each be a blocking upload on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from engine import SamplingParams
from engine.sample import SamplingMetadata, SamplingRow
from engine.sample.metadata import add_row_features
from engine.sample.sampling_slots import SamplingSlots


def _ways(batch: int, ns: argparse.Namespace) -> dict[str, Callable[[], None]]:
    params = SamplingParams(
        temperature=0.8, top_p=0.9, seed=1, repetition_penalty=1.2 if ns.penalties else 1.0
    )
    prompt = list(range(3, 3 + 8))
    outputs = [[(7 * i + j) % ns.vocab_size for j in range(16)] for i in range(batch)]
    slots = SamplingSlots(torch.device("cpu"), penalties_on_device=ns.penalties_on_device)
    sampled = torch.zeros(batch, dtype=torch.int64)

    def sampling_rows() -> list[SamplingRow]:
        return [
            SamplingRow(params=params, prompt_token_ids=prompt, output_token_ids=out, seed=i)
            for i, out in enumerate(outputs)
        ]

    def rebuild() -> None:
        SamplingMetadata.build(sampling_rows(), ns.vocab_size, "cpu")

    step = [0]

    def gather() -> None:
        rows = [
            (str(i), params, i, len(out) + step[0], prompt, out) for i, out in enumerate(outputs)
        ]
        metadata, needs_rows = slots.metadata(rows, ns.vocab_size)
        if needs_rows:  # what the runner adds per step (engine/worker/step_sampler.py)
            add_row_features(metadata, sampling_rows(), "cpu")
        slots.advance(sampled)
        step[0] += 1  # as if every row had one token in flight more each step

    gather()  # the join: every slot written once
    return {"rebuild": rebuild, "slots": gather}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--penalties", action="store_true", help="repetition_penalty 1.2")
    parser.add_argument("--penalties-on-device", action="store_true", help="count them as on a GPU")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>6} {'rebuild, CPU us/step':>24} {'slots, CPU us/step':>24} {'ratio':>6}")
    with torch.inference_mode():
        for batch in ns.batch_sizes:
            ways = _ways(batch, ns)
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(ns.repeats):
                for name, way in ways.items():
                    start = time.process_time()
                    for _ in range(ns.steps):
                        way()
                    times[name].append(1e6 * (time.process_time() - start) / ns.steps)
            medians = {name: statistics.median(values) for name, values in times.items()}
            cells = [f"{medians[n]:8.1f} ({min(times[n]):.1f}..{max(times[n]):.1f})" for n in ways]
            ratio = medians["slots"] / medians["rebuild"]
            print(f"{batch:>6} {cells[0]:>24} {cells[1]:>24} {ratio:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
