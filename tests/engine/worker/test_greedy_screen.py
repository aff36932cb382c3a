"""Engines with the greedy screen (engine/layers/greedy_screen.py): which rows it serves,
and the same tokens as the fp32 LM head on an fp32 model and on a GGUF file whose tied
LM head stays Q8_0, in batches that mix screened rows with rows that need the logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.native import native_kernels_available
from engine.worker.step_sampler import wants_argmax_only
from tests.model_utils import make_tiny_llama


def _supported() -> bool:
    from engine.native import greedy_screen

    return greedy_screen.supported()


needs_screen = pytest.mark.skipif(
    not native_kernels_available() or not _supported(),
    reason="the greedy screen needs native kernels on x86 (AVX2 or AVX-512)",
)


def _request(output_len: int = 0, grammar: object = None, **params) -> SimpleNamespace:
    return SimpleNamespace(
        sampling_params=SamplingParams(**params),
        output_token_ids=[1] * output_len,
        structured_output=None if grammar is None else SimpleNamespace(matcher=grammar),
    )


def test_which_rows_want_only_the_argmax():
    assert wants_argmax_only(_request(temperature=0.0))
    assert wants_argmax_only(_request(temperature=0.0, min_tokens=3, output_len=3))
    assert not wants_argmax_only(_request(temperature=0.8, seed=1))
    for extra in (
        {"logprobs": 0},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"logit_bias": {3: 1.0}},
        {"allowed_token_ids": [3, 4]},
        {"bad_words_token_ids": [[3]]},
        {"logits_processors": [lambda ids, logits: logits]},
        {"min_tokens": 4},
    ):
        assert not wants_argmax_only(_request(temperature=0.0, **extra)), extra
    assert not wants_argmax_only(_request(grammar=object(), temperature=0.0))


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _compare_with_and_without(llm: LLM, prompts, params) -> int:
    """Runs the batch with the screen and without; asserts the same outputs, returns how
    many rows the screen served."""
    model = llm.llm_engine.runner.model
    screen = model.greedy_screen
    assert screen is not None
    served = []
    argmax = screen.argmax

    def counting(hidden):
        served.append(hidden.shape[0])
        return argmax(hidden)

    screen.argmax = counting
    with_screen = _run(llm, prompts, params)
    llm.llm_engine.reset_prefix_cache()
    model.greedy_screen = None
    try:
        without = _run(llm, prompts, params)
    finally:
        model.greedy_screen = screen
    # The same tokens; the logprobs rows' logits come from a smaller GEMM with the screen
    # (the other rows left it), so their values may differ in the last bits.
    assert [tokens for tokens, _ in with_screen] == [tokens for tokens, _ in without]
    for (_, ours), (_, theirs) in zip(with_screen, without):
        assert (ours is None) == (theirs is None)
        for step_ours, step_theirs in zip(ours or [], theirs or []):
            assert step_ours.keys() == step_theirs.keys()
            for token, entry in step_ours.items():
                assert entry.logprob == pytest.approx(step_theirs[token].logprob, abs=1e-4)
    return sum(served)


@needs_screen
def test_fp32_engine_mixed_batch_matches_the_fp32_head(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "model", hidden_size=96, vocab_size=1000)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",  # the screen computes in fp32
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=8 * 2**20,
    )
    prompts = [[5 + i, 17, 33 + 7 * i, 9, 400 + i] for i in range(6)]
    served = _compare_with_and_without(llm, prompts, _mixed_params())
    # Plain greedy rows (0 and 5) every step, the min_tokens row once it may stop: at least
    # 2 * 16 rows, and never the rows with logprobs, sampling or penalties (3 * 16).
    assert 32 <= served <= 3 * 16


@needs_screen
def test_gguf_engine_screens_its_q8_0_head(tmp_path, tokenizer_fields):
    from tests.engine.gguf_files import write_tiny_llama_gguf
    from tests.engine.layers.test_quantization import _SCALES

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tokenizer_fields, _SCALES)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 * 2**20)
    model = llm.llm_engine.runner.model
    assert model.quantized_logits is not None and model.greedy_screen is not None
    prompts = [[5, 17, 33, 9], [40, 2, 77, 101, 12, 64, 3, 90, 11], [7], [300, 301, 302]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)
    assert _compare_with_and_without(llm, prompts, params) == 12 * len(prompts)
