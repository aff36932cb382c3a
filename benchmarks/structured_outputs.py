"""Structured decoding overhead at batch 64 on the default model: JSON-schema requests vs
unconstrained ones, in the same run; and the grammar compile time of each test schema.

Both runs decode 64 requests at once with the same prompts, seeds and temperature. The
figure is the engine step time while all 64 requests are decoding (prefill steps and the
tail where finished requests thin the batch are left out, since constrained outputs end
earlier), divided by 64: time per output token at batch 64. The constrained run's grammars
are compiled (and cached) by a warm-up request first, so it is the per-token cost of masks
and grammar state, not of compilation (reported separately).

    .venv/bin/python benchmarks/structured_outputs.py [--batch 64] [--max-tokens 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from tests.engine.test_structured_outputs import SCHEMAS


def _run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[float]:
    """Durations (s) of the steps in which every request was decoding."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, p)
    durations = []
    while engine.has_unfinished_requests():
        all_decoding = len(engine.scheduler.running) == len(prompts) and all(
            r.num_output_tokens > 0 for r in engine.scheduler.running
        )
        start = time.perf_counter()
        engine.step()
        if all_decoding:
            durations.append(time.perf_counter() - start)
    return durations


def compile_times(llm: LLM) -> list[float]:
    """Cold compile time (ms) of each schema, on the engine's backend."""
    manager = llm.llm_engine.structured_output_manager
    backend = manager._get_backend()  # built once; not part of any schema's time
    times = []
    for schema in SCHEMAS:
        start = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema))
        times.append(1000.0 * (time.perf_counter() - start))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(kv_cache_memory_bytes=256 * 2**20, max_num_seqs=args.batch)
    times = compile_times(llm)
    print(
        f"compile (xgrammar, {len(SCHEMAS)} schemas, ms): median {statistics.median(times):.1f}, "
        f"max {max(times):.1f}, all {[round(t, 1) for t in times]}"
    )
    prompts = [f"Record {i} as JSON:" for i in range(args.batch)]

    def params(i: int, constrained: bool) -> SamplingParams:
        so = None
        if constrained:
            schema = SCHEMAS[i % len(SCHEMAS)]
            so = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
        return SamplingParams(
            temperature=0.8, seed=i, max_tokens=args.max_tokens, structured_outputs=so
        )

    constrained = [params(i, True) for i in range(args.batch)]
    plain = [params(i, False) for i in range(args.batch)]
    llm.generate(prompts[: len(SCHEMAS)], constrained[: len(SCHEMAS)], use_tqdm=False)  # warm
    per_token: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.repeats):  # alternate, so load changes hit both alike
        for name, batch_params in (("unconstrained", plain), ("json_schema", constrained)):
            steps = _run(llm, prompts, batch_params)
            per_token[name] += [1000.0 * s / args.batch for s in steps]
    base = statistics.median(per_token["unconstrained"])
    json_ms = statistics.median(per_token["json_schema"])
    counts = {k: len(v) for k, v in per_token.items()}
    print(f"batch {args.batch}, ms per output token (median over full-batch steps {counts}):")
    print(f"  unconstrained {base:.3f}  json_schema {json_ms:.3f}  ratio {json_ms / base:.3f}")


if __name__ == "__main__":
    main()
