"""`LoRAManager`: the engine's loaded adapters and their application to a step's batch.

    add_lora / remove_lora / list_loras / pin_lora      loaded adapters, LRU beyond
                                                        max_cpu_loras (pinned ones stay)
    prepare(batch)       per step: the adapters present get slots in rank-padded stacks
                         (rebuilt only when that set changes) and each token its slot
    forward hooks        on every adapted linear layer of the model: add the batched
                         shrink/expand (ops.add_lora) to the layer's output columns

Fused projections (qkv_proj = q | k | v, gate_up_proj = gate | up) take each part's update
in its column range, read from the layer's `output_sizes` and the model's
`packed_modules_mapping`, so the model code knows nothing of LoRA. A step whose tokens all
run the base model skips the hooks' work entirely.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from engine.config.engine_config import LoRAConfig
from engine.lora.adapter import LoRAAdapter, linear_shapes, load_peft_adapter
from engine.lora.ops import add_lora, stack_lora_weights
from engine.lora.request import LoRARequest


class LoRAManager:
    def __init__(
        self, config: LoRAConfig, hf_config: Any, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        self.dtype, self.device = dtype, device
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU order
        self._requests: dict[int, LoRARequest] = {}
        self._pinned: set[int] = set()
        self._slot_ids: tuple[int, ...] = ()  # adapter ids in the stacks, by slot
        self._stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._indices: torch.Tensor | None = None  # [num_tokens] slot, -1 = base
        self._hooks: list[Any] = []
        # The batched update: the Triton kernel on CUDA, grouped GEMMs on the CPU.
        self._add_lora = add_lora
        if device.type == "cuda":
            from kernels.lora import add_lora_triton

            self._add_lora = add_lora_triton

    # ---- the adapter registry -----------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> bool:
        """Loads (and checks) the adapter; False if its id is loaded already."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}.")
        known = self._requests.get(request.lora_int_id)
        if known is not None:
            if known.lora_name != request.lora_name:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already adapter "
                    f"{known.lora_name!r}, not {request.lora_name!r}."
                )
            self._adapters.move_to_end(request.lora_int_id)
            return False
        adapter = load_peft_adapter(
            request.lora_path,
            self.hf_config,
            self.config.max_lora_rank,
            name=request.lora_name,
            int_id=request.lora_int_id,
            dtype=self.dtype,
        )
        self._evict_for_one_more()
        self._adapters[request.lora_int_id] = adapter
        self._requests[request.lora_int_id] = request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        if lora_id not in self._adapters:
            return False
        del self._adapters[lora_id], self._requests[lora_id]
        self._pinned.discard(lora_id)
        if lora_id in self._slot_ids:
            self._slot_ids, self._stacks = (), {}
        return True

    def list_loras(self) -> set[int]:
        return set(self._adapters)

    def pin_lora(self, lora_id: int) -> bool:
        if lora_id not in self._adapters:
            raise ValueError(f"LoRA adapter {lora_id} is not loaded: add_lora() it first.")
        self._pinned.add(lora_id)
        return True

    def _evict_for_one_more(self) -> None:
        while len(self._adapters) >= self.config.num_cpu_loras:
            victim = next((i for i in self._adapters if i not in self._pinned), None)
            if victim is None:
                raise ValueError(
                    f"All {len(self._adapters)} loaded adapters are pinned "
                    f"(max_cpu_loras={self.config.num_cpu_loras}): unpin or remove one."
                )
            self.remove_lora(victim)

    # ---- per step -------------------------------------------------------------------------

    def prepare(self, token_adapters: Sequence[tuple[LoRARequest | None, int]]) -> bool:
        """(adapter of a request, its number of tokens this step) in batch order. Returns
        True when some token runs an adapter (the hooks then apply)."""
        ids = [r.lora_int_id if r is not None else 0 for r, _ in token_adapters]
        present = tuple(sorted(set(ids) - {0}))
        if not present:
            self._indices = None
            return False
        for lora_id in present:  # most recently used: a reload below never evicts them
            if lora_id in self._adapters:
                self._adapters.move_to_end(lora_id)
        for request, _ in token_adapters:
            if request is not None and request.lora_int_id not in self._adapters:
                self.add_lora(request)  # evicted since it was added: load it again
        if present != self._slot_ids:
            self._build_stacks(present)
        slot_of = {lora_id: slot for slot, lora_id in enumerate(present)}
        per_token = [slot_of.get(i, -1) for i, (_, n) in zip(ids, token_adapters) for _ in range(n)]
        self._indices = torch.tensor(per_token, device=self.device)  # [num_tokens]
        return True

    def _build_stacks(self, present: tuple[int, ...]) -> None:
        adapters = [self._adapters[i] for i in present]
        max_rank = max(a.rank for a in adapters)
        modules = sorted({m for a in adapters for m in a.target_modules})
        shapes = linear_shapes(self.hf_config)
        stacks = {}
        for layer in range(int(self.hf_config.num_hidden_layers)):
            for module in modules:
                out_features, in_features = shapes[module]
                slots = [a.layer_weights(layer, module) for a in adapters]
                if any(w is not None for w in slots):
                    stacks[(layer, module)] = stack_lora_weights(
                        slots, max_rank, out_features, in_features, self.dtype, self.device
                    )
        self._slot_ids, self._stacks = present, stacks

    # ---- the model ------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module) -> None:
        """Hooks every adapted linear layer of `model` (again after a reload)."""
        for hook in self._hooks:
            hook.remove()
        packed = getattr(model, "packed_modules_mapping", {})
        self._hooks = []
        for layer, decoder_layer in enumerate(model.model.layers):
            for name, module in decoder_layer.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                parts = packed.get(leaf, (leaf,))
                if not any(p in linear_shapes(self.hf_config) for p in parts):
                    continue
                sizes = getattr(module, "output_sizes", None) or (module.out_features,)
                self._hooks.append(
                    module.register_forward_hook(self._make_hook(layer, parts, sizes))
                )

    def _make_hook(self, layer: int, parts: tuple[str, ...], sizes: Sequence[int]) -> Any:
        bounds = []
        start = 0
        for part, size in zip(parts, sizes, strict=True):
            bounds.append((part, start, start + size))
            start += size

        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            if self._indices is None:
                return
            x = args[0]  # [num_tokens, in_features]
            for part, begin, end in bounds:
                stack = self._stacks.get((layer, part))
                if stack is not None:
                    self._add_lora(output[:, begin:end], x, stack[0], stack[1], self._indices)

        return hook
