"""FINAL_ONLY samples with nothing to deliver per step (engine/processing/output_processor.py,
`_is_quiet`) are passed over until they finish; their text is detokenized then. The final
outputs must equal what a step-by-step sample delivers: whole, and when aborted midway."""

from __future__ import annotations

import pytest

from engine import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from engine.api.detokenizer import IncrementalDetokenizer
from tests.model_utils import make_tiny_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    model_dir = make_tiny_llama(
        tmp_path_factory.mktemp("tiny-text"), with_tokenizer=True, max_position_embeddings=256
    )
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32"))


def _prompt(engine: LLMEngine) -> dict:
    return {"prompt_token_ids": list(engine.get_tokenizer()("Once upon a time").input_ids)}


def _final(engine: LLMEngine, request_id: str, kind: RequestOutputKind, n: int = 1):
    params = SamplingParams(max_tokens=12, ignore_eos=True, output_kind=kind, n=n, seed=5)
    engine.add_request(request_id, _prompt(engine), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    (final,) = [o for o in outputs if o.finished]
    if kind == RequestOutputKind.FINAL_ONLY:
        assert outputs == [final], "a FINAL_ONLY request delivers its final output only"
    return final


@pytest.mark.parametrize("n", [1, 2])
def test_final_only_equals_cumulative(engine, n) -> None:
    quiet = _final(engine, f"q{n}", RequestOutputKind.FINAL_ONLY, n)
    loud = _final(engine, f"c{n}", RequestOutputKind.CUMULATIVE, n)
    assert len(quiet.outputs) == n
    for a, b in zip(quiet.outputs, loud.outputs):
        assert a.text and a.text == b.text
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.finish_reason,
            b.stop_reason,
        )


def test_aborted_final_only_has_the_text_of_its_tokens(engine) -> None:
    params = SamplingParams(
        max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    prompt = _prompt(engine)
    engine.add_request("aborted", prompt, params)
    for _ in range(6):
        assert engine.step() == []
    engine.abort_request("aborted")
    outputs = []
    while engine.has_unfinished_requests() or not outputs:
        outputs.extend(engine.step())
    (final,) = outputs
    (completion,) = final.outputs
    assert completion.finish_reason == "abort" and len(completion.token_ids) >= 4
    reference = IncrementalDetokenizer(engine.get_tokenizer(), prompt["prompt_token_ids"])
    for token_id in completion.token_ids:  # one by one, as a streaming sample is
        reference.update([token_id])
    assert completion.text == reference.get_text(finished=True)
    assert completion.text
