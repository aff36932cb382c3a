"""The small-batch whole-step decode (engine/attention/cpu_decode_step.py over
decode_step_kernels.c): 1..8 rows, fp32 and quantized weights, every ISA path of the row
kernels, against the model's own forward; and engines at batch 1..8 against transformers
on a tiny GGUF file."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.api.model_files import load_hf_config
from engine.attention.cpu_backend import CPUAttentionBackend
from engine.attention.cpu_decode_step import MAX_ROWS, MAX_ROWS_FP32
from engine.loader.model_loader import load_model
from engine.native import native_kernels_available
from engine.native.decode_step import decode_step, step_layer_table
from engine.native.quant import QType, available_isas, set_isa
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.model_utils import allocate_block_tables, build_attn_metadata, make_tiny_llama

pytestmark = pytest.mark.skipif(
    not native_kernels_available(), reason="no C compiler: native kernels unavailable"
)

SHAPE = dict(hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=2, intermediate_size=96)
BIASED = dict(
    hidden_size=32,
    num_heads=4,
    num_kv_heads=1,
    head_dim=8,
    num_layers=2,
    intermediate_size=64,
    attention_bias=True,
    mlp_bias=True,
)


@pytest.fixture(params=[isa.name for isa in available_isas()])
def isa(request):
    """Each row-kernel path this CPU runs, forced, then automatic again."""
    from engine.native.quant import Isa

    set_isa(Isa[request.param])
    yield request.param
    set_isa(None)


def _step_against_forward(
    model, backend, shape: dict, rows: int, seed: int = 0, lens: list[int] | None = None
) -> None:
    """Prefills `rows` prompts of different lengths (`lens`, or short ones), then one decode
    token each through the whole-step path and through the modules (on a copy of the
    caches): same hidden states, same caches."""
    decode_step_fn = backend.whole_step_decode(model)
    assert decode_step_fn is not None
    config = model.config
    block_size, num_blocks = 4, 64
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_heads"]
    cache_shape = (2, num_blocks, block_size, shape["num_kv_heads"], head_dim)
    caches = [torch.zeros(cache_shape) for _ in range(shape["num_layers"])]
    gen = torch.Generator().manual_seed(seed)
    lens = lens or [3 + (5 * i) % 11 for i in range(rows)]
    tables = allocate_block_tables([n + 1 for n in lens], block_size, num_blocks, seed=seed)
    with torch.inference_mode():
        for n, table in zip(lens, tables, strict=True):
            prompt = torch.randint(3, config.vocab_size, (n,), generator=gen)
            prefill = build_attn_metadata([(0, n, table)], block_size=block_size)
            model(prompt, torch.arange(n), caches, prefill)
        decode = build_attn_metadata(
            [(n, 1, t) for n, t in zip(lens, tables, strict=True)], block_size=block_size
        )
        tokens = torch.randint(3, config.vocab_size, (rows,), generator=gen)
        positions = torch.tensor(lens)
        layer_caches = [c.clone() for c in caches]
        # Beyond its row limit the runner does not take the path; the kernel still computes.
        limit = MAX_ROWS_FP32 if decode_step_fn.fp32 else MAX_ROWS
        assert decode_step_fn.applies(decode) == (rows <= limit)
        fast = decode_step_fn(tokens, positions, caches, decode)
        expected = model(tokens, positions, layer_caches, decode)
    torch.testing.assert_close(fast, expected, atol=2e-4, rtol=2e-4)
    for ours, theirs in zip(caches, layer_caches, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models by (shape name, quantization), each built once for the module."""
    built = {}

    def get(name: str, quantization: str | None):
        if (name, quantization) not in built:
            path = make_tiny_llama(tmp_path_factory.mktemp(name), **SHAPES[name])
            backend = CPUAttentionBackend()
            model = load_model(
                path,
                load_hf_config(path),
                torch.float32,
                torch.device("cpu"),
                backend,
                quantization=quantization,
            )
            built[name, quantization] = (model, backend)
        return built[name, quantization]

    return get


SHAPES = {"gqa": SHAPE, "mqa-biases": BIASED}


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_step_matches_the_modules(models, isa, quantization, name):
    model, backend = models(name, quantization)
    for rows in (1, 2, 5, 8):
        _step_against_forward(model, backend, SHAPES[name], rows, seed=rows)


@pytest.mark.parametrize("name", list(SHAPES))
def test_step_splits_long_contexts_of_one_row(models, name):
    """At batch 1 the quantized step's attention has fewer items (KV heads) than twice the
    threads, so each context is split into block-aligned key ranges whose outputs are
    merged: lengths that cut blocks unevenly, one block, and a part left empty all match
    the modules. (One fp32 row takes decode_token, whose items are the query heads.)"""
    model, backend = models(name, "int8")
    for n in (4, 5, 37, 61, 150):
        _step_against_forward(model, backend, SHAPES[name], 1, seed=n, lens=[n])


def test_step_does_not_apply_to_prefill_or_large_batches(models):
    tables = [[i] for i in range(9)]
    for quantization, limit in ((None, MAX_ROWS_FP32), ("int8", MAX_ROWS)):
        model, backend = models("gqa", quantization)
        step = backend.whole_step_decode(model)
        mixed = build_attn_metadata([(2, 1, [0]), (0, 2, [1])], block_size=4)
        assert not step.applies(mixed)
        decodes = [(2, 1, t) for t in tables[: limit + 1]]
        assert not step.applies(build_attn_metadata(decodes, block_size=4))
        assert step.applies(build_attn_metadata(decodes[:limit], block_size=4))


def test_decode_step_rejects_bad_inputs():
    hidden = torch.zeros(2, 8)
    cos = sin = torch.zeros(2, 4)
    tables, seq_lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    slots = torch.zeros(2, dtype=torch.int64)
    shape = dict(num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8, block_size=4)
    table = torch.zeros(0, 4, dtype=torch.int64)

    def call(**changes):
        args = dict(hidden=hidden, cos=cos, sin=sin, block_tables=tables, seq_lens=seq_lens)
        args["slot_mapping"] = slots
        args.update(changes)
        return decode_step(
            table=table, max_len=1, shape=shape, eps=1e-5, scale=0.5, window=None, **args
        )

    with pytest.raises(ValueError, match="hidden"):
        call(hidden=hidden.double())
    with pytest.raises(ValueError, match="cos"):
        call(cos=cos[:1])
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=seq_lens.long())
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=slots.int())
    with pytest.raises(ValueError, match="parts"):
        step_layer_table(
            [
                {
                    "input_norm": None,
                    "post_norm": None,
                    "key_cache": None,
                    "value_cache": None,
                    "qkv": (None, []),
                }
            ]
        )


# Block types of the tiny GGUF file's projections: the fused q|k|v and gate|up mix types.
_SCALES = {
    QType.Q8_0: 0.01,
    QType.Q4_0: 0.03,
    QType.Q4_1: 0.03,
    QType.Q4_K: 0.004,
    QType.Q6_K: 0.0003,
}


def test_gguf_engine_batches_match_transformers(tmp_path, tokenizer_fields):
    """Batches of 1, 3 and 8 requests decode through the quantized whole-step path."""
    from tests.engine.gguf_files import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tokenizer_fields, _SCALES)
    llm = LLM(
        model=str(path), dtype="float32", kv_cache_memory_bytes=8 * 2**20, quantization="gguf"
    )
    runner = llm.llm_engine.runner
    assert runner._decode_step is not None and not runner._decode_step.fp32
    model_dir = llm.llm_engine.get_model_config().model_dir
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    gen = torch.Generator().manual_seed(3)
    batches = [
        [
            torch.randint(3, 200, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 12, (batch,), generator=gen)
        ]
        for batch in (1, 3, 8)
    ]
    ours = []
    for prompts in batches:
        ours += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    prompts = [p for batch in batches for p in batch]
    assert_close_to_reference(hf_greedy(model_dir, prompts, 10), ours_greedy(ours))
