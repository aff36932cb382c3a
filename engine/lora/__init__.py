"""LoRA adapters: `request.py` (vLLM's `LoRARequest`, torch-free), `adapter.py` (PEFT
loading with validation), `ops.py` (batched shrink/expand), `manager.py` (the engine's
loaded adapters and their forward hooks). Only the request type is imported here, so
`engine` stays importable without torch."""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
