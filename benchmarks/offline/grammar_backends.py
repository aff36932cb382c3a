"""xgrammar vs llguidance on the default model's tokenizer (49152 tokens), on this CPU.

For each library: the one-time tokenizer setup, the compile time of a few realistic JSON
schemas, and the time to fill the token masks of a batch of 64 requests per decode step
(each request walking a valid instance of the schema, at staggered positions so the batch
holds different grammar states). Prints medians in milliseconds.

    .venv/bin/python benchmarks/offline/grammar_backends.py [--batch 64] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.api.model_files import load_tokenizer
from engine.loader.model_dir import resolve_model

VOCAB_SIZE = 49152
EOS = 2

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
            },
            "status": {"enum": ["active", "inactive", "banned"]},
        },
        "required": ["name", "age", "address", "status"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 10,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "price": {"type": "number", "minimum": 0},
                    },
                    "required": ["sku", "quantity", "price"],
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["id", "items", "paid"],
    },
}

INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["math", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "status": "active",
}


def _median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def bench_xgrammar(tokenizer, token_ids: list[int], batch: int, steps: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup = time.perf_counter() - t0
    compile_ms = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        compile_ms[name] = 1000.0 * (time.perf_counter() - t0)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMAS["person"]), strict_mode=True)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    for i, m in enumerate(matchers):  # stagger: row i starts i tokens in
        for t in token_ids[: i % (len(token_ids) - steps)]:
            assert m.accept_token(t)
    offsets = [i % (len(token_ids) - steps) for i in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, VOCAB_SIZE)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)
        times.append(time.perf_counter() - t0)
        for row, m in enumerate(matchers):
            assert m.accept_token(token_ids[offsets[row] + step])
    return {"setup_ms": 1000 * setup, "compile_ms": compile_ms, "mask_ms": _median_ms(times)}


def bench_llguidance(tokenizer, token_ids: list[int], batch: int, steps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE, eos_token=EOS)
    executor = llguidance.LLExecutor()
    setup = time.perf_counter() - t0
    compile_ms = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
        matcher = llguidance.LLMatcher(lltok, grammar)
        matcher.compute_bitmask()  # llguidance compiles lazily: count the first mask
        assert not matcher.is_error(), matcher.get_error()
        compile_ms[name] = 1000.0 * (time.perf_counter() - t0)
    grammar = llguidance.grammar_from("json_schema", json.dumps(SCHEMAS["person"]))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    offsets = [i % (len(token_ids) - steps) for i in range(batch)]
    for m, off in zip(matchers, offsets):
        assert m.consume_tokens(token_ids[:off]), m.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(batch, VOCAB_SIZE)
    times, times_par = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        for row, m in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(m, bitmask, row)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(
            executor, [(m, row) for row, m in enumerate(matchers)], bitmask
        )
        times_par.append(time.perf_counter() - t0)
        for row, m in enumerate(matchers):
            assert m.consume_token(token_ids[offsets[row] + step]), m.get_error()
    return {
        "setup_ms": 1000 * setup,
        "compile_ms": compile_ms,
        "mask_ms": _median_ms(times),
        "mask_par_ms": _median_ms(times_par),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(resolve_model(None))
    token_ids = tokenizer(json.dumps(INSTANCE), add_special_tokens=False).input_ids
    assert len(token_ids) > args.steps + 8, "instance too short for --steps"
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        r = fn(tokenizer, token_ids, args.batch, args.steps)
        compile_text = ", ".join(f"{k} {v:.1f} ms" for k, v in r["compile_ms"].items())
        line = (
            f"{name:10s} tokenizer setup {r['setup_ms']:.0f} ms | compile: {compile_text} | "
            f"mask fill, batch {args.batch}: {r['mask_ms']:.2f} ms/step"
        )
        if "mask_par_ms" in r:
            line += f" ({r['mask_par_ms']:.2f} ms/step with its parallel executor)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
