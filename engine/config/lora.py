"""LoRA serving limits (`EngineArgs.enable_lora` and friends; engine/lora/ serves them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's `LoRAConfig` (set when `enable_lora=True`)."""

    max_loras: int = 1  # adapters in one batch
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded (LRU beyond); None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
