"""Hugging Face transformers as the correctness reference (DESIGN.md, "Correctness reference").

Greedy tokens must match `generate`; where float noise makes the two sides diverge at a
near-tie, each side's token must be within the other's top-5 at the first divergence
(the check vLLM's own tests use), and the comparison of that sequence stops there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import RequestOutput

TOP_K = 5


@dataclass
class Greedy:
    token_ids: list[int]
    top_ids: list[set[int]]  # per generated position: the top-5 token ids


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: torch.dtype = torch.float32,
    **load_kwargs: Any,
) -> list[Greedy]:
    """Runs transformers `generate` greedily on each prompt alone (no padding), never
    stopping at EOS, in `dtype`, and keeps each position's top-5. `load_kwargs` go to
    `from_pretrained` (a quantized checkpoint's `quantization_config`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **load_kwargs).eval()
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        top = [set(logits[0].topk(TOP_K).indices.tolist()) for logits in out.logits]
        results.append(Greedy(tokens, top))
    return results


def ours_greedy(outputs: list[RequestOutput]) -> list[Greedy]:
    """Our outputs (requested with logprobs=5) in the same shape."""
    results = []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None, "request logprobs=5 to compare with HF"
        top = [
            {tid for tid, lp in pos.items() if lp.rank is not None and lp.rank <= TOP_K}
            for pos in completion.logprobs
        ]
        results.append(Greedy(list(completion.token_ids), top))
    return results


def assert_close_to_reference(reference: list[Greedy], ours: list[Greedy]) -> None:
    assert len(reference) == len(ours)
    for i, (ref, got) in enumerate(zip(reference, ours)):
        assert len(got.token_ids) == len(ref.token_ids), f"prompt {i}: lengths differ"
        for pos, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
            if a == b:
                continue
            assert b in ref.top_ids[pos] and a in got.top_ids[pos], (
                f"prompt {i}: diverged at position {pos} ({b} vs reference {a}), "
                "outside each other's top-5"
            )
            break
