"""LoRA adapters: the request type, PEFT loading with validation, and the batched
shrink/expand ops. Not wired into the model runner yet: `add_request(lora_request=...)`
still raises NotImplementedError."""

from engine.lora.adapter import LoRAAdapter, LoRALayerWeights, load_peft_adapter
from engine.lora.ops import add_lora, add_lora_reference, stack_lora_weights
from engine.lora.request import LoRARequest

__all__ = [
    "LoRAAdapter",
    "LoRALayerWeights",
    "LoRARequest",
    "add_lora",
    "add_lora_reference",
    "load_peft_adapter",
    "stack_lora_weights",
]
