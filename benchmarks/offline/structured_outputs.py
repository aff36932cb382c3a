"""Structured decoding overhead at batch 64 on the default model: JSON-schema requests vs
unconstrained ones, in the same run; and the grammar compile time of each test schema.

Both runs decode 64 requests at once with the same prompts, seeds and temperature. The
figure is the engine step time while all 64 requests are decoding (prefill steps and the
tail where finished requests thin the batch are left out, since constrained outputs end
earlier), divided by 64: time per output token at batch 64. The constrained run's grammars
are compiled (and cached) by a warm-up request first, so it is the per-token cost of masks
and grammar state, not of compilation (reported separately).

`--schemas long` (the default) uses record-list schemas whose answers cannot end before
`--max-tokens` (arrays with a high `minItems`), so every step of both runs is a full-batch
decode step and the two medians rest on the same number of steps; `--schemas tests` uses the
test suite's twelve schemas, whose answers mostly end after 10-20 tokens.

    python benchmarks/offline/structured_outputs.py [--batch 64] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.api.sampling_params import SamplingParams
from engine.llm import LLM
from engine.structured_output import StructuredOutputsParams
from tests.engine.structured_output.test_structured_outputs import SCHEMAS


def _long_schemas() -> list[dict]:
    """Realistic extraction schemas (nested objects, enums, bounded strings and numbers) with
    lists long enough that no answer completes within the benchmark's token budget."""
    tag = {"enum": ["new", "used", "refurbished", "sale", "limited"]}
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{2,8}@[a-z]{2,8}\\.(com|org)$"},
        },
        "required": ["name", "age", "email"],
    }
    product = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "tags": {"type": "array", "items": tag, "minItems": 1, "maxItems": 3},
            "in_stock": {"type": "boolean"},
        },
        "required": ["sku", "price", "tags", "in_stock"],
    }
    point = {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
    }
    return [
        {
            "type": "object",
            "properties": {key: {"type": "array", "items": item, "minItems": 40}},
            "required": [key],
        }
        for key, item in (("people", person), ("products", product), ("path", point))
    ]


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


def compile_times(llm: LLM, schemas: list[dict]) -> list[float]:
    """Cold compile time (ms) of each schema, on the engine's backend."""
    manager = llm.llm_engine.structured_output_manager
    backend = manager._get_backend()  # built once; not part of any schema's time
    times = []
    for schema in schemas:
        start = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema))
        times.append(1000.0 * (time.perf_counter() - start))
    return times


def sampler_overhead(llm: LLM, batch: int, repeats: int = 20) -> tuple[float, float]:
    """Median ms of one batch-`batch` sampling step (temperature 0.8, seeded) without and
    with grammar rows: the bitmask fill by every row's matcher plus the masked sampling.
    Isolates the structured-output cost from the forward pass, which dominates a step."""
    import torch

    from engine.sample import Sampler, SamplingMetadata, SamplingRow

    manager = llm.llm_engine.structured_output_manager
    backend = manager._get_backend()
    vocab = llm.llm_engine.get_model_config().vocab_size
    compiled = [backend.compile(StructuredOutputsParams(json=s)) for s in SCHEMAS]
    params = SamplingParams(temperature=0.8, seed=1)
    logits = torch.randn(batch, vocab)  # [B, V]
    sampler = Sampler()

    def rows(grammar: bool) -> list[SamplingRow]:
        return [
            SamplingRow(
                params, [1, 2, 3], [], seed=i,
                grammar=backend.new_matcher(compiled[i % len(compiled)]) if grammar else None,
            )
            for i in range(batch)
        ]  # fmt: skip

    medians = []
    for grammar in (False, True):
        batch_rows = rows(grammar)
        times = []
        for _ in range(repeats):
            step_logits = logits.clone()  # the mask goes in place; each step starts afresh
            start = time.perf_counter()
            sampler(step_logits, SamplingMetadata.build(batch_rows, vocab, "cpu"))
            times.append(1000.0 * (time.perf_counter() - start))
        medians.append(statistics.median(times))
    return medians[0], medians[1]


def mask_application(llm: LLM, batch: int, repeats: int = 20) -> tuple[float, float]:
    """Median ms to apply real batch-`batch` JSON-schema masks (each schema's first-token
    mask) to fresh [B, V] logits: the sampler's in-place byte-table op vs xgrammar's own
    CPU kernel (the reason the sampler does not use it)."""
    import torch
    import xgrammar

    from engine.sample.token_controls import apply_grammar_bitmask_

    backend = llm.llm_engine.structured_output_manager._get_backend()
    vocab = llm.llm_engine.get_model_config().vocab_size
    compiled = [backend.compile(StructuredOutputsParams(json=s)) for s in SCHEMAS]
    bitmask = torch.full((batch, -(-vocab // 32)), -1, dtype=torch.int32)  # [B, W]
    for i in range(batch):
        backend.new_matcher(compiled[i % len(compiled)]).fill_bitmask(bitmask, i)
    logits = torch.randn(batch, vocab)  # [B, V]
    medians = []
    for apply in (
        lambda x: apply_grammar_bitmask_(x, bitmask),
        lambda x: xgrammar.apply_token_bitmask_inplace(x, bitmask),
    ):
        times = []
        for _ in range(repeats):
            fresh = logits.clone()
            start = time.perf_counter()
            apply(fresh)
            times.append(1000.0 * (time.perf_counter() - start))
        medians.append(statistics.median(times))
    return medians[0], medians[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schemas", choices=("long", "tests"), default="long")
    parser.add_argument("--sampler-only", action="store_true", help="skip the engine runs")
    args = parser.parse_args()
    llm = LLM(kv_cache_memory_bytes=256 * 2**20, max_num_seqs=args.batch)
    bench_schemas = _long_schemas() if args.schemas == "long" else SCHEMAS
    for name, schemas in (("test", SCHEMAS), ("long", _long_schemas())):
        times = compile_times(llm, schemas)
        print(
            f"compile (xgrammar, {len(schemas)} {name} schemas, ms): median "
            f"{statistics.median(times):.1f}, max {max(times):.1f}, "
            f"all {[round(t, 1) for t in times]}"
        )
    plain_ms, grammar_ms = sampler_overhead(llm, args.batch)
    print(
        f"sampling step, batch {args.batch} (metadata + sampler, ms): unconstrained "
        f"{plain_ms:.2f}  json_schema {grammar_ms:.2f} (+{grammar_ms - plain_ms:.2f} ms per step)"
    )
    table_ms, xgrammar_ms = mask_application(llm, args.batch)
    print(
        f"mask application, batch {args.batch}, in place (ms): byte table {table_ms:.2f}  "
        f"xgrammar CPU kernel {xgrammar_ms:.2f}"
    )
    if args.sampler_only:
        return
    prompts = [f"Record {i} as JSON:" for i in range(args.batch)]

    def params(i: int, constrained: bool) -> SamplingParams:
        so = None
        if constrained:
            schema = bench_schemas[i % len(bench_schemas)]
            so = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
        return SamplingParams(
            temperature=0.8, seed=i, max_tokens=args.max_tokens, structured_outputs=so
        )

    constrained = [params(i, True) for i in range(args.batch)]
    plain = [params(i, False) for i in range(args.batch)]
    warm = len(bench_schemas)
    llm.generate(prompts[:warm], constrained[:warm], use_tqdm=False)  # compiles, warms
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
    print(f"schemas: {args.schemas}; CPU: {_cpu_model()}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
