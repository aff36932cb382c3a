"""LLMEngine's API as vLLM documents it: adding, stepping, streaming, aborting, priorities,
validation, outputs, stats. Tiny random models (with the default model's tokenizer where
text is involved)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from engine import (
    CompletionOutput,
    EngineArgs,
    LLMEngine,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from tests.model_utils import make_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=128)


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-text"), with_tokenizer=True, max_position_embeddings=256
    )


def make_engine(model_dir, **kwargs) -> LLMEngine:
    """fp32 unless asked: the tests compare with transformers in fp32 and count fp32 bytes
    ("auto" is bf16 on CPUs where bf16 is native)."""
    kwargs.setdefault("dtype", "float32")
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), **kwargs))


def drain(engine: LLMEngine, max_steps: int = 1000) -> list[RequestOutput]:
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        outputs.extend(engine.step())
    outputs.extend(engine.step())  # abort outputs still pending, if any
    return outputs


def all_blocks_free(engine: LLMEngine) -> bool:
    return engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks


def tokens(n: int, start: int = 3) -> dict:
    return {"prompt_token_ids": [start + (i % 100) for i in range(n)]}


# ---- the seed-document examples -------------------------------------------------------------


def test_streaming_loop_over_step(text_model_dir) -> None:
    engine = make_engine(text_model_dir)
    prompts = ["To be or not to be,", "What is the meaning of life?", "It is only with the heart"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, output_kind=RequestOutputKind.DELTA),
        SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=10),
        SamplingParams(temperature=0.0, n=2, max_tokens=8, output_kind=RequestOutputKind.DELTA),
    ]
    request_id = 0
    streamed: dict[tuple[str, int], list[str]] = {}
    finals: dict[str, RequestOutput] = {}
    while prompts or engine.has_unfinished_requests():
        if prompts:
            engine.add_request(str(request_id), prompts.pop(0), params.pop(0))
            request_id += 1
        for output in engine.step():
            for completion in output.outputs:
                streamed.setdefault((output.request_id, completion.index), []).append(
                    completion.text
                )
            if output.finished:
                finals[output.request_id] = output
    assert set(finals) == {"0", "1", "2"}
    assert all_blocks_free(engine)
    tokenizer = engine.get_tokenizer()
    # DELTA: only new text each time; CUMULATIVE: everything so far, decoded from the tokens.
    assert len(streamed[("0", 0)]) > 1 and "".join(streamed[("0", 0)])
    cumulative = finals["1"].outputs[0]
    assert cumulative.text == tokenizer.decode(cumulative.token_ids, skip_special_tokens=True)
    assert streamed[("1", 0)][-1] == cumulative.text
    assert len(streamed[("2", 0)]) >= 1 and len(streamed[("2", 1)]) >= 1


def test_delta_outputs_concatenate_to_the_cumulative_result(text_model_dir) -> None:
    engine = make_engine(text_model_dir)
    prompt = "Once upon a time"
    engine.add_request(
        "delta",
        prompt,
        SamplingParams(temperature=0.0, max_tokens=20, output_kind=RequestOutputKind.DELTA),
    )
    engine.add_request("cumulative", prompt, SamplingParams(temperature=0.0, max_tokens=20))
    text, ids = "", []
    final = None
    for output in drain(engine):
        if output.request_id == "delta":
            text += output.outputs[0].text
            ids += output.outputs[0].token_ids
        elif output.finished:
            final = output.outputs[0]
    assert final is not None
    assert ids == final.token_ids and text == final.text


def test_aborting_three_of_ten_requests_midway(model_dir) -> None:
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(10):
        engine.add_request(f"req-{i}", tokens(5 + i, start=3 + i), params)
    finished: dict[str, RequestOutput] = {}
    for step in range(100):
        if step == 5:
            engine.abort_request(["req-1", "req-4"])
            engine.abort_request("req-7")
            engine.abort_request("req-7")  # idempotent
            engine.abort_request("no-such-request")
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(finished) == 10
    for rid, output in finished.items():
        completion = output.outputs[0]
        if rid in ("req-1", "req-4", "req-7"):
            assert completion.finish_reason == "abort"
            assert len(completion.token_ids) < 30
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == 30
    assert engine.get_num_unfinished_requests() == 0
    assert all_blocks_free(engine)


def test_priority_ten_request_is_scheduled_first(model_dir) -> None:
    engine = make_engine(model_dir, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, priority in enumerate([0, 0, 10, 5]):
        engine.add_request(
            f"p{priority}-{i}", tokens(6, start=10 * i + 3), params, priority=priority
        )
    order = [o.request_id for o in drain(engine) if o.finished]
    assert order == ["p10-2", "p5-3", "p0-0", "p0-1"]


def test_priority_needs_the_priority_policy(model_dir) -> None:
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match="scheduling_policy"):
        engine.add_request("x", tokens(4), SamplingParams(), priority=3)


# ---- validation -------------------------------------------------------------------------


def test_bad_requests_raise_and_leave_the_engine_usable(model_dir) -> None:
    engine = make_engine(model_dir, max_model_len=64, num_gpu_blocks_override=3, block_size=16)
    params = SamplingParams(max_tokens=4)
    engine.add_request("live", tokens(4), params)
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(7, tokens(4), params)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("live", tokens(4), params)
    with pytest.raises(ValueError, match=r"length 65.*maximum model length of 64"):
        engine.add_request("long", tokens(65), params)
    with pytest.raises(ValueError, match=r"length 60.*4 KV-cache blocks.*3 blocks"):
        engine.add_request("never-fits", tokens(60), params)
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_request("lora", tokens(4), params, lora_request=object())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, params)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", {"prompt_token_ids": [1, 10_000]}, params)
    with pytest.raises(TypeError, match="prompt"):
        engine.add_request("weird", 42, params)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logprobs=50 exceeds max_logprobs=20"):
        engine.add_request("lp", tokens(4), SamplingParams(logprobs=50))
    outputs = drain(engine)
    assert [o.request_id for o in outputs if o.finished] == ["live"]
    assert all_blocks_free(engine)


def test_text_prompt_without_tokenizer_is_a_clear_error(model_dir) -> None:
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("t", "hello", SamplingParams())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert params.max_tokens == 16 and params.min_tokens == 0 and params.seed is None
    assert params.stop == [] and params.stop_token_ids == [] and not params.ignore_eos
    assert params.skip_special_tokens and not params.include_stop_str_in_output
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert SamplingParams(top_k=-1).top_k == 0


# ---- outputs ------------------------------------------------------------------------------


def test_output_fields_metrics_and_final_only(model_dir) -> None:
    engine = make_engine(model_dir)
    engine.add_request(
        "r",
        tokens(9),
        SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        ),
    )
    outputs = drain(engine)
    assert len(outputs) == 1  # FINAL_ONLY: one output
    (output,) = outputs
    assert output.finished and output.prompt_token_ids == tokens(9)["prompt_token_ids"]
    completion = output.outputs[0]
    assert isinstance(completion, CompletionOutput)
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.cumulative_logprob is None and completion.logprobs is None
    m = output.metrics
    assert m is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.finished_time is not None and m.time_in_queue is not None and m.time_in_queue >= 0


def test_stop_token_ids_report_the_stop_reason(model_dir) -> None:
    engine = make_engine(model_dir)
    engine.add_request("free", tokens(7), SamplingParams(temperature=0.0, max_tokens=6))
    (free,) = [o for o in drain(engine) if o.finished]
    stop_at = free.outputs[0].token_ids[2]
    engine.add_request(
        "stopped",
        tokens(7),
        SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at]),
    )
    (stopped,) = [o for o in drain(engine) if o.finished]
    first = free.outputs[0].token_ids.index(stop_at)
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop_at


def test_stop_strings_cut_the_text(text_model_dir) -> None:
    engine = make_engine(text_model_dir)
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request("free", "The quick brown fox", base)
    (free,) = [o for o in drain(engine) if o.finished]
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a non-blank stop string in {text!r}"
    for include in (False, True):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        engine.add_request(f"stop-{include}", "The quick brown fox", params)
        (out,) = [o for o in drain(engine) if o.finished]
        cut = text.index(stop) + (len(stop) if include else 0)
        assert out.outputs[0].text == text[:cut]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert len(out.outputs[0].token_ids) < 24
    assert all_blocks_free(engine)


def test_logprobs_and_prompt_logprobs_match_transformers(model_dir) -> None:
    from transformers import AutoModelForCausalLM

    engine = make_engine(model_dir, max_num_batched_tokens=8)  # prompt split into chunks
    prompt = tokens(13)["prompt_token_ids"]
    engine.add_request(
        "lp",
        {"prompt_token_ids": prompt},
        SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2
        ),
    )
    (out,) = [o for o in drain(engine) if o.finished]
    completion = out.outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    full = prompt + completion.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0], dim=-1)  # [len, vocab]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry is not None and prompt[pos] in entry
        assert entry[prompt[pos]].logprob == pytest.approx(
            ref[pos - 1, prompt[pos]].item(), abs=1e-4
        )
        assert len(entry) <= 3  # the prompt token + top-2
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    total = 0.0
    for i, entry in enumerate(completion.logprobs):
        token = completion.token_ids[i]
        expected = ref[len(prompt) + i - 1]
        assert entry[token].rank == 1  # greedy
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
        top3 = expected.topk(3).indices.tolist()
        assert set(top3) <= set(entry)
        assert [entry[t].rank for t in top3] == [1, 2, 3]
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_n_samples_share_the_prompt_blocks(model_dir) -> None:
    for caching in (True, False):
        engine = make_engine(model_dir, block_size=4, enable_prefix_caching=caching)
        engine.add_request(
            "n", tokens(18), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6)
        )
        engine.step()
        tables = [engine.kv_cache_manager.get_block_ids(f"n#{i}") for i in range(3)]
        # 18 prompt tokens = 4 full blocks of 4, shared; each sample owns its last block.
        assert tables[0][:4] == tables[1][:4] == tables[2][:4]
        assert len({t[4] for t in tables}) == 3
        final = next(o for o in drain(engine) if o.finished)
        assert sorted(c.index for c in final.outputs) == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # different samples
        assert all_blocks_free(engine)


def test_same_seed_same_tokens_whatever_the_batch(model_dir) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = make_engine(model_dir)
    alone.add_request("x", tokens(11), params)
    (expected,) = [o for o in drain(alone) if o.finished]
    busy = make_engine(model_dir, max_num_batched_tokens=24)
    for i in range(6):
        busy.add_request(
            f"other-{i}", tokens(3 + 5 * i, start=40 + i), SamplingParams(max_tokens=20)
        )
    busy.add_request("x", tokens(11), params)
    got = next(o for o in drain(busy) if o.request_id == "x" and o.finished)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    other_seed = make_engine(model_dir)
    other_seed.add_request("x", tokens(11), SamplingParams(temperature=1.0, seed=99, max_tokens=16))
    (different,) = [o for o in drain(other_seed) if o.finished]
    assert different.outputs[0].token_ids != expected.outputs[0].token_ids


# ---- engine plumbing ----------------------------------------------------------------------


def test_config_getters_stats_and_prefix_cache_reset(model_dir, caplog) -> None:
    engine = make_engine(model_dir, block_size=8, max_num_seqs=4, kv_cache_memory_bytes=2**20)
    model_config = engine.get_model_config()
    assert model_config.dtype == "float32" and model_config.vocab_size == 128
    cache = engine.get_cache_config()
    per_block = 2 * 8 * model_config.num_kv_heads * model_config.head_dim * 4 * 2
    assert cache.num_blocks == min(2**20 // per_block, 4 * math.ceil(128 / 8))
    assert engine.get_scheduler_config().max_num_seqs == 4
    assert engine.get_device_config().device == "cpu"
    engine.add_request("a", tokens(20), SamplingParams(max_tokens=2))
    drain(engine)
    engine.add_request("b", tokens(20), SamplingParams(max_tokens=2))
    drain(engine)
    with caplog.at_level(logging.INFO, logger="engine.observability.stats"):
        line = engine.do_log_stats()
    assert "Running: 0 reqs" in line and "Waiting: 0 reqs" in line
    assert "Prefix cache hit rate: 40.0%" in line  # b found 16 of its 20 tokens
    assert "KV cache usage: 0.0%" in line and line in caplog.text
    assert engine.reset_prefix_cache()
    engine.add_request("c", tokens(20), SamplingParams(max_tokens=2))
    drain(engine)
    assert "Prefix cache hit rate: 0.0%" in engine.do_log_stats()
