"""Beam search equals transformers' `generate(num_beams=k, do_sample=False, ...)` token for
token (all k returned beams, in order) on tiny random models and the default model."""

from __future__ import annotations

import pytest
import torch

from engine.api.sampling_params import BeamSearchParams
from engine.llm import LLM

PROMPTS = [[1, 15, 99, 7, 42], [1, 3, 3, 80, 11, 64, 2 + 20, 9, 17, 33, 5, 6, 70, 90, 100, 4, 8]]


def _hf_beams(model, prompt, k, max_tokens, length_penalty, early_stopping) -> list[list[int]]:
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            pad_token_id=eos,
            eos_token_id=eos,
        )
    beams = []
    for row in out.tolist():
        generated = row[len(prompt) :]
        if eos in generated:  # cut the padding after EOS
            generated = generated[: generated.index(eos) + 1]
        beams.append(generated)
    return beams


def _ours(llm, prompts, k, max_tokens, length_penalty, early_stopping) -> list[list[list[int]]]:
    params = BeamSearchParams(
        beam_width=k,
        max_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    return [
        [beam.tokens[len(p) :] for beam in output.sequences] for p, output in zip(prompts, outputs)
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 128-token vocabulary (EOS = 2): some beams finish early, so EOS handling, length
    penalty and early stopping all matter."""
    from transformers import LlamaForCausalLM

    from tests.model_utils import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("beam"), vocab_size=128, seed=3)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 * 2**20), hf


@pytest.mark.parametrize(
    ("k", "length_penalty", "early_stopping"),
    [(2, 1.0, False), (4, 0.5, True), (4, 2.0, "never"), (2, -1.0, True)],
)
def test_tiny_model_matches_transformers(tiny, k, length_penalty, early_stopping) -> None:
    llm, hf = tiny
    prompts = [[p % 128 for p in prompt] for prompt in PROMPTS]
    ours = _ours(llm, prompts, k, 10, length_penalty, early_stopping)
    for prompt, beams in zip(prompts, ours):
        assert beams == _hf_beams(hf, prompt, k, 10, length_penalty, early_stopping)
    assert llm.llm_engine.kv_cache_manager.usage == 0.0


def test_default_model_matches_transformers() -> None:
    from transformers import LlamaForCausalLM

    from engine.loader.model_dir import resolve_model

    path = resolve_model(None)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20)
    prompt = list(llm.get_tokenizer()("The three primary colors are").input_ids)
    for k in (2, 4):
        (ours,) = _ours(llm, [prompt], k, 8, 1.0, False)
        assert ours == _hf_beams(hf, prompt, k, 8, 1.0, False)


def test_outputs_carry_text_scores_and_reject_bad_params(tiny) -> None:
    llm, _ = tiny
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    (output,) = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)
    scores = [beam.score for beam in output.sequences]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    for beam in output.sequences:
        assert beam.tokens[: len(PROMPTS[0])] == PROMPTS[0]
        assert beam.cum_logprob == pytest.approx(
            sum(next(iter(d.values())).logprob for d in beam.logprobs)
        )
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
