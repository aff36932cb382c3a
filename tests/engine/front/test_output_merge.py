"""Outputs that queued up while their consumer was busy come out as one
(engine/front/output_merge.py): the same tokens, logprobs, finish reasons and cumulative
logprobs as a consumer that read every step, in fewer outputs."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLMEngine, EngineArgs, RequestOutput, RequestOutputKind, SamplingParams
from engine.api.outputs import CompletionOutput, Logprob
from engine.front.output_merge import merge_outputs
from tests.model_utils import make_tiny_llama

DELTA = RequestOutputKind.DELTA


def _completion(index, token_ids, finish=None, logprob=None):
    logprobs = None if logprob is None else [{t: Logprob(logprob)} for t in token_ids]
    return CompletionOutput(
        index=index,
        text="".join(f"<{t}>" for t in token_ids),
        token_ids=list(token_ids),
        cumulative_logprob=None if logprob is None else logprob * len(token_ids),
        logprobs=logprobs,
        finish_reason=finish,
    )


def _output(completions, finished=False, prompt_logprobs=None):
    return RequestOutput("r", None, [1, 2], prompt_logprobs, completions, finished)


def test_delta_outputs_concatenate_per_index_and_the_later_one_finishes() -> None:
    first = _output(
        [_completion(0, [5], logprob=-1.0), _completion(1, [7], logprob=-2.0)],
        prompt_logprobs=[None, {2: Logprob(-0.5)}],
    )
    later = _output([_completion(1, [8, 9], finish="length", logprob=-3.0)], finished=True)
    merged = merge_outputs(first, later, DELTA)
    by_index = {c.index: c for c in merged.outputs}
    assert by_index[0].token_ids == [5]
    assert by_index[1].token_ids == [7, 8, 9]
    assert by_index[1].text == "<7><8><9>"
    assert [next(iter(p)) for p in by_index[1].logprobs] == [7, 8, 9]
    assert by_index[1].finish_reason == "length"
    assert by_index[1].cumulative_logprob == -6.0  # the later one's running sum
    assert merged.finished and merged.prompt_logprobs == first.prompt_logprobs
    assert first.outputs[1].token_ids == [7]  # the inputs are left as they were


def test_cumulative_outputs_keep_the_latest() -> None:
    first = _output([_completion(0, [5])])
    later = _output([_completion(0, [5, 6])])
    assert merge_outputs(first, later, RequestOutputKind.CUMULATIVE) is later


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-merge"), max_position_embeddings=256)
    args = EngineArgs(model=str(model), dtype="float32", max_model_len=256, max_num_seqs=8)
    engine = AsyncLLMEngine.from_engine_args(args)
    yield engine
    engine.shutdown()


def _params() -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=7, n=2, max_tokens=24, ignore_eos=True, logprobs=2, output_kind=DELTA
    )


def _per_index(outputs: list[RequestOutput]) -> dict[int, dict]:
    result: dict[int, dict] = {}
    for output in outputs:
        for c in output.outputs:
            entry = result.setdefault(c.index, {"tokens": [], "logprobs": []})
            entry["tokens"] += c.token_ids
            entry["logprobs"] += [{t: lp.logprob for t, lp in p.items()} for p in c.logprobs]
            entry["finish"], entry["cumulative"] = c.finish_reason, c.cumulative_logprob
    return result


def test_a_consumer_that_falls_behind_gets_the_same_output_in_fewer_outputs(engine) -> None:
    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        fast = [o async for o in engine.generate({"prompt_token_ids": [3, 4, 5]}, _params(), "f")]
        stream = engine.generate({"prompt_token_ids": [3, 4, 5]}, _params(), "s")
        slow = [await stream.__anext__()]
        await engine.wait_until_idle(timeout=60)  # every later step is queued, unread
        await asyncio.sleep(0.05)
        slow += [o async for o in stream]
        return fast, slow

    fast, slow = asyncio.run(run())
    # (how many outputs the reading consumer gets depends on the machine's load: a reader
    # that keeps up gets one per step, one that falls behind for a moment fewer)
    assert len(slow) <= 3
    assert slow[-1].finished
    got, want = _per_index(slow), _per_index(fast)
    assert got == want
    assert [len(v["tokens"]) for v in got.values()] == [24, 24]
