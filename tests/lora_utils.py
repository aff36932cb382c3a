"""A random PEFT LoRA adapter for a tiny model the test made (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    alpha: float,
    targets: list[str],
    seed: int,
    use_rslora: bool = False,
    b_std: float = 0.3,
) -> Any:
    """Saves a PEFT adapter of the model in `base_dir` to `out_dir` and returns the PEFT
    model (merge it with `merge_and_unload()` for a reference). PEFT starts lora_B at zero;
    here it is random too, so the adapter really changes the output."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=targets,
        init_lora_weights="gaussian",
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    peft_model.save_pretrained(out_dir)
    return peft_model
