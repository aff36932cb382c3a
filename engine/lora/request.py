"""`LoRARequest`: which adapter a request runs with (vLLM's class of the same name)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id (unique per adapter in one engine) and the
    PEFT directory it loads from (`adapter_config.json` + `adapter_model.safetensors`).

    As in vLLM, two requests name the same adapter when their `lora_name`s are equal."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}.")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty str, got {self.lora_path!r}.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
