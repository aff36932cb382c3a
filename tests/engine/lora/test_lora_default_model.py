"""LoRA on the default model (SmolLM2-135M): a random PEFT adapter on attention and MLP,
in one batch with the base model, gives the greedy tokens of transformers with the adapter
merged by PEFT (top-5 tolerant at a near-tie, as every correctness test here)."""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.loader.model_dir import resolve_model
from tests.engine.reference import Greedy, assert_close_to_reference, ours_greedy
from tests.lora_utils import make_peft_adapter

pytestmark = pytest.mark.slow

MAX_TOKENS = 10


def test_default_model_with_a_random_adapter(tmp_path) -> None:
    import torch

    base_dir = resolve_model(None)
    peft_model = make_peft_adapter(
        base_dir,
        tmp_path / "adapter",
        rank=8,
        alpha=16,
        targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        seed=0,
        b_std=0.02,
    )
    merged = peft_model.merge_and_unload().eval()  # the reference, kept in memory
    merged.generation_config.eos_token_id = None
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, enable_lora=True, max_lora_rank=8)
    prompt = llm.get_tokenizer()("The capital of France is").input_ids
    lora = LoRARequest("random", 1, str(tmp_path / "adapter"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate(
        [{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False, lora_request=[lora, None]
    )
    ours = ours_greedy(outputs)
    with torch.no_grad():
        out = merged.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    reference = Greedy(
        out.sequences[0, len(prompt) :].tolist(),
        [set(logits[0].topk(5).indices.tolist()) for logits in out.logits],
    )
    assert_close_to_reference([reference], ours[:1])
    assert ours[0].token_ids != ours[1].token_ids  # the adapter changes the answer
