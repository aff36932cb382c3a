"""vLLM's multi-LoRA offline example (`examples/offline_inference/multilora_inference.py`),
as written but for the model: a tiny local Llama and a random PEFT adapter instead of the
hub's Llama-2 and its SQL adapter. `LLMEngine.from_engine_args(EngineArgs(enable_lora=True,
max_loras=1, max_lora_rank=8, max_cpu_loras=2, max_num_seqs=256))`, text prompts queued
with `add_request(..., lora_request=)` while stepping until `has_unfinished_requests()` is
False; the same adapter registered under two names runs in separate steps (max_loras=1)."""

from __future__ import annotations

from engine import EngineArgs, LLMEngine, LoRARequest, RequestOutput, SamplingParams
from tests.lora_utils import make_peft_adapter
from tests.model_utils import make_tiny_llama


def create_test_prompts(lora_path: str) -> list[tuple[str, SamplingParams, LoRARequest | None]]:
    """Two base-model requests and two per adapter name, as the example's (shorter)."""
    greedy_with_logprobs = dict(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=8)
    return [
        ("A robot may not injure a human being", SamplingParams(**greedy_with_logprobs), None),
        (
            "To be or not to be,",
            SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=8),
            None,
        ),
        (
            "Write a SQL query for the table",
            SamplingParams(**greedy_with_logprobs),
            LoRARequest("sql-lora", 1, lora_path),
        ),
        (
            "Name the ICAO for the airport",
            SamplingParams(temperature=0.0, logprobs=1, max_tokens=8),
            LoRARequest("sql-lora", 1, lora_path),
        ),
        (
            "Write a SQL query for the table",
            SamplingParams(**greedy_with_logprobs),
            LoRARequest("sql-lora2", 2, lora_path),
        ),
        (
            "Name the ICAO for the airport",
            SamplingParams(temperature=0.0, logprobs=1, max_tokens=8),
            LoRARequest("sql-lora2", 2, lora_path),
        ),
    ]


def process_requests(
    engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams, LoRARequest | None]]
) -> tuple[dict[str, RequestOutput], list[set[str]]]:
    """The example's loop; also records which requests got a token in each step."""
    request_id = 0
    finished: dict[str, RequestOutput] = {}
    steps: list[set[str]] = []
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params, lora_request = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params, lora_request=lora_request)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        steps.append({o.request_id for o in request_outputs})
        for request_output in request_outputs:
            if request_output.finished:
                finished[request_output.request_id] = request_output
    return finished, steps


def test_multilora_inference_example(tmp_path) -> None:
    base_dir = make_tiny_llama(tmp_path / "base", with_tokenizer=True, max_position_embeddings=128)
    lora_path = tmp_path / "sql-lora"
    make_peft_adapter(base_dir, lora_path, rank=8, alpha=16, targets=["q_proj", "v_proj"], seed=5)
    engine_args = EngineArgs(
        model=str(base_dir),
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        max_cpu_loras=2,
        max_num_seqs=256,
        kv_cache_memory_bytes=1 << 22,  # not in the example: a small cache for the test
    )
    engine = LLMEngine.from_engine_args(engine_args)
    finished, steps = process_requests(engine, create_test_prompts(str(lora_path)))

    assert sorted(finished) == [str(i) for i in range(6)]
    for request_id, output in finished.items():
        completion = output.outputs[0]
        assert completion.token_ids and completion.text
        if request_id != "1":  # the one request that asks for no logprobs
            assert len(completion.logprobs) == len(completion.token_ids)
    assert output_tokens(finished, "0") and finished["0"].prompt_logprobs is not None
    # One adapter under two names: the same greedy tokens, unlike the base model's.
    assert output_tokens(finished, "2") == output_tokens(finished, "4")
    assert output_tokens(finished, "3") == output_tokens(finished, "5")
    base = LLMEngine.from_engine_args(engine_args)
    base_sql, _ = process_requests(base, [(*create_test_prompts(str(lora_path))[2][:2], None)])
    assert output_tokens(base_sql, "0") != output_tokens(finished, "2")
    # max_loras=1: a step never runs the two adapter names together.
    assert not any({"2", "3"} & step and {"4", "5"} & step for step in steps)
    assert engine.list_loras() == {1, 2}


def output_tokens(finished: dict[str, RequestOutput], request_id: str) -> list[int]:
    return list(finished[request_id].outputs[0].token_ids)
