"""`LoRAManager`: the engine's loaded adapters and their application to a step's batch.

    add_lora / remove_lora / list_loras / pin_lora      loaded adapters, LRU beyond
                                                        max_cpu_loras (pinned ones stay)
    prepare(batch)       per step: the adapters present get slots in rank-padded stacks
                         (rebuilt only when that set changes) and each token its slot,
                         in a device index uploaded only when the layout changes
                         (slot_index.py: one pinned non-blocking copy on a GPU)
    forward hooks        on every adapted linear layer of the model: add the batched
                         shrink/expand (ops.add_lora) to the layer's output columns

Fused projections (qkv_proj = q | k | v, gate_up_proj = gate | up) take each part's update
in its column range, read from the layer's `output_sizes` and the model's
`packed_modules_mapping`, so the model code knows nothing of LoRA. A step whose tokens all
run the base model skips the hooks' work entirely.

Under tensor parallelism each rank applies its shard of an adapter, cut where the layer's
`checkpoint_slices` cut the base weights (Megatron's layout, as vLLM's LoRA layers)::

    column-parallel (q, k, v, gate, up)   lora_B's rows of this rank; lora_A whole
    row-parallel (o, down)                lora_A's columns of this rank; lora_B whole, the
                                          update added to the partial product before the sum

Under pipeline parallelism only this stage's layers are hooked and stacked.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from engine.config.lora import LoRAConfig
from engine.distributed.sharding import RowSlice
from engine.lora.adapter import LoRAAdapter, LoRALayerWeights, linear_shapes, load_peft_adapter
from engine.lora.ops import add_lora, stack_lora_weights
from engine.lora.request import LoRARequest
from engine.lora.slot_index import SlotIndex


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
        self.slot_index = SlotIndex(device)  # where `_indices` lives on the device
        self._hooks: list[Any] = []
        self._layers: list[int] = []  # the hooked layers (this pipeline stage's)
        # module -> (dimension cut, rows kept) where this rank holds a shard (TP)
        self._shards: dict[str, tuple[int, RowSlice]] = {}
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
        runs = [(slot_of.get(i, -1), n) for i, (_, n) in zip(ids, token_adapters)]
        self._indices = self.slot_index.update(runs)  # [num_tokens]
        return True

    def _build_stacks(self, present: tuple[int, ...]) -> None:
        adapters = [self._adapters[i] for i in present]
        max_rank = max(a.rank for a in adapters)
        modules = sorted({m for a in adapters for m in a.target_modules})
        full = linear_shapes(self.hf_config)
        shapes = {m: self._shard_shape(m, *shape) for m, shape in full.items()}
        stacks = {}
        for layer in self._layers:
            for module in modules:
                out_features, in_features = shapes[module]
                slots = [self._shard(module, a.layer_weights(layer, module)) for a in adapters]
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
        self._hooks, self._layers, self._shards = [], [], {}
        self._slot_ids, self._stacks = (), {}  # stacks are cut for the hooked layers
        for layer, decoder_layer in enumerate(model.model.layers):
            hooked = False
            for name, module in decoder_layer.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                parts = packed.get(leaf, (leaf,))
                if not any(p in linear_shapes(self.hf_config) for p in parts):
                    continue
                self._record_shards(parts, module)
                sizes = getattr(module, "output_sizes", None) or (module.out_features,)
                hook = self._make_hook(layer, parts, sizes)
                # A row-parallel layer's update goes in before the sum over the TP group.
                register = getattr(module, "register_partial_hook", module.register_forward_hook)
                self._hooks.append(register(hook))
                hooked = True
            if hooked:
                self._layers.append(layer)

    def _record_shards(self, parts: tuple[str, ...], module: torch.nn.Module) -> None:
        """Where `module` holds a shard of each part's weight (nothing in a world of one)."""
        cut = getattr(module, "checkpoint_slices", {}).get("weight")
        if cut is None:
            return
        dim, slices = cut
        for part, rows in zip(parts, slices, strict=True):
            self._shards[part] = (dim, rows)

    def _shard_shape(self, module: str, out_features: int, in_features: int) -> tuple[int, int]:
        dim, rows = self._shards.get(module, (None, None))
        if rows is None:
            return out_features, in_features
        return (rows.size, in_features) if dim == 0 else (out_features, rows.size)

    def _shard(self, module: str, weights: LoRALayerWeights | None) -> LoRALayerWeights | None:
        """This rank's part of one layer's update: lora_B's rows of a column-parallel
        layer, lora_A's columns of a row-parallel one."""
        dim, rows = self._shards.get(module, (None, None))
        if weights is None or rows is None:
            return weights
        a, b, cut = weights.lora_a, weights.lora_b, slice(rows.start, rows.start + rows.size)
        a, b = (a, b[cut]) if dim == 0 else (a[:, cut], b)
        return LoRALayerWeights(a.contiguous(), b.contiguous(), weights.scaling)

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
