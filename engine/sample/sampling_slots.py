"""Sampling parameters that persist across steps, one slot per request (a persistent batch,
as in vLLM v1): the sampler's per-row tensors are gathered from here, not rebuilt from Python
lists each step.

A request takes a slot the first step it samples and keeps it until it leaves (finished,
aborted or preempted: `drop`). Its values are written once into host arrays, which mirror a
device buffer of the same bytes; a step copies the whole buffer up (one copy, through pinned
memory where the runner pins, without waiting) only when some slot was written. The batch's
rows are gathered from the slots with an index tensor, uploaded only when the batch's slots
change::

    host (numpy, one byte buffer)                      device (uint8, the same layout)
    ints   [3, capacity] int64    seed | top_k | position       ─┐ one copy, only in a step
    floats [6, capacity] float32  temperature | top_p | min_p |  ├ where a slot was written
                                  presence | frequency | repetition ─┘
    step:  index [B] (the rows' slots)  ->  ints[:, index], floats[:, index]  ->  metadata

The position (the output index of the token being sampled, the seeded sampler's counter)
moves every step: `advance` adds 1 to the sampled slots' positions on the device and in the
host mirror alike, so the two stay equal without a copy. Each step the host compares the
mirror with each row's true position (tokens so far + placeholders in flight) and writes a
slot that moved otherwise (a preempted request recomputed, a migrated stream resumed, a
request that took the greedy screen in between).

Values are stored as `SamplingMetadata.build` makes them (greedy rows get temperature 0 and
the filters off), so a row samples the same token either way. Only the host arrays are read
by the host (which filters any row uses, the largest top_k): never the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.api.sampling_params import SamplingParams, SamplingType
from engine.sample.metadata import SamplingMetadata, needs_row_features, to_int64

Pin = Callable[[torch.Tensor], torch.Tensor]
# (request id, parameters, seed, position of the token being sampled) per row, batch order.
SlotRow = tuple[str, SamplingParams, int, int]

_SEED, _TOP_K, _POSITION = range(3)  # rows of the int64 block
_NUM_INTS = 3
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)  # float32 rows
_NUM_FLOATS = 6


class SamplingSlots:
    def __init__(self, device: torch.device, pin: Pin | None = None, capacity: int = 8) -> None:
        """`pin` copies a host tensor into pinned memory (uploads then do not wait for the
        device); None uploads plainly."""
        self.device = device
        self.pin = pin
        self._held: dict[str, tuple[int, SamplingParams, int]] = {}  # id -> slot, params, seed
        self._free: list[int] = []
        self._capacity = 0
        self._dirty = False
        self._index_key: list[int] = []  # the slots `_index` holds, in batch order
        self._index: torch.Tensor | None = None  # [B] int64 on the device
        self._last: tuple[np.ndarray, torch.Tensor] | None = None  # the last gather's slots
        self.num_uploads = 0  # copies of the buffer (index uploads not counted)
        self._grow(capacity)

    # ---- joining and leaving ---------------------------------------------------------

    def drop(self, request_ids: set[str]) -> None:
        """Gives back the slots of requests that finished, were aborted or preempted."""
        for request_id in request_ids:
            held = self._held.pop(request_id, None)
            if held is not None:
                self._free.append(held[0])

    def _join(self, request_id: str, params: SamplingParams, seed: int, vocab_size: int) -> int:
        """Writes the request's values into its slot (a free one if it has none)."""
        held = self._held.get(request_id)
        if held is not None:
            slot = held[0]
        else:
            if not self._free:
                self._grow(2 * self._capacity)
            slot = self._free.pop()
        greedy = params.sampling_type == SamplingType.GREEDY
        top_k = params.top_k if not greedy and 0 < params.top_k < vocab_size else 0
        self._ints[:, slot] = (to_int64(seed), top_k, -1)  # position: set by the caller
        self._floats[:, slot] = (
            0.0 if greedy else params.temperature,
            1.0 if greedy else params.top_p,
            0.0 if greedy else params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        self._num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self._row_features[slot] = needs_row_features(params)
        self._held[request_id] = (slot, params, seed)
        self._dirty = True
        return slot

    def _grow(self, capacity: int) -> None:
        """Host arrays and device buffer for `capacity` slots, the old slots' values kept."""
        old = self._capacity
        num_bytes = capacity * (_NUM_INTS * 8 + _NUM_FLOATS * 4)
        host = np.zeros(num_bytes, dtype=np.uint8)
        ints = host[: capacity * _NUM_INTS * 8].view(np.int64).reshape(_NUM_INTS, capacity)
        floats = host[capacity * _NUM_INTS * 8 :].view(np.float32).reshape(_NUM_FLOATS, capacity)
        num_logprobs = np.full(capacity, -1, dtype=np.int64)
        row_features = np.zeros(capacity, dtype=bool)
        if old:
            ints[:, :old] = self._ints
            floats[:, :old] = self._floats
            num_logprobs[:old] = self._num_logprobs
            row_features[:old] = self._row_features
        self._host, self._ints, self._floats = host, ints, floats
        self._num_logprobs, self._row_features = num_logprobs, row_features
        device = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        self._device = device
        self._device_ints = device[: capacity * _NUM_INTS * 8].view(torch.int64)
        self._device_ints = self._device_ints.view(_NUM_INTS, capacity)
        self._device_floats = device[capacity * _NUM_INTS * 8 :].view(torch.float32)
        self._device_floats = self._device_floats.view(_NUM_FLOATS, capacity)
        self._free.extend(range(capacity - 1, old - 1, -1))  # lowest slots first
        self._capacity = capacity
        self._dirty = True

    # ---- the step ----------------------------------------------------------------------

    def metadata(self, rows: Sequence[SlotRow], vocab_size: int) -> tuple[SamplingMetadata, bool]:
        """The batch's sampling tensors gathered from the slots (the rows' tokens, grammar
        and token lists not filled: `add_row_features`), and whether any row's parameters
        need those features."""
        held = self._held
        slot_list: list[int] = []
        for request_id, params, seed, _ in rows:
            entry = held.get(request_id)
            if entry is None or entry[1] is not params or entry[2] != seed:
                slot_list.append(self._join(request_id, params, seed, vocab_size))
            else:
                slot_list.append(entry[0])
        slots = np.array(slot_list, dtype=np.int64)  # [B]
        positions = np.array([row[3] for row in rows], dtype=np.int64)  # [B]
        moved = self._ints[_POSITION, slots] != positions
        if moved.any():
            self._ints[_POSITION, slots[moved]] = positions[moved]
            self._dirty = True
        if self._dirty:
            self._upload()
        index = self._index_of(slot_list)
        self._last = (slots, index)
        ints = self._device_ints.index_select(1, index)  # [3, B]
        floats = self._device_floats.index_select(1, index)  # [6, B]
        host_ints = self._ints[:, slots]  # [3, B], the host's copy of the same values
        host_floats = self._floats[:, slots]  # [6, B]
        greedy = host_floats[_TEMPERATURE] == 0.0
        top_k = host_ints[_TOP_K]
        max_top_k = int(top_k.max(initial=0))
        num_logprobs = int(self._num_logprobs[slots].max(initial=-1))

        def used(row: int, off: float) -> torch.Tensor | None:
            return floats[row] if bool((host_floats[row] != off).any()) else None

        metadata = SamplingMetadata(
            vocab_size=vocab_size,
            temperature=floats[_TEMPERATURE],
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            seeds=ints[_SEED],
            positions=ints[_POSITION],
            top_k=ints[_TOP_K] if max_top_k else None,
            max_top_k=max_top_k,
            top_p=used(_TOP_P, 1.0),
            min_p=used(_MIN_P, 0.0),
            presence_penalties=used(_PRESENCE, 0.0),
            frequency_penalties=used(_FREQUENCY, 0.0),
            repetition_penalties=used(_REPETITION, 1.0),
            output_row_ids=None,
            output_token_ids=None,
            output_token_counts=None,
            seen_row_ids=None,
            seen_token_ids=None,
            min_tokens_row_ids=None,
            min_tokens_token_ids=None,
            max_num_logprobs=num_logprobs if num_logprobs >= 0 else None,
        )
        return metadata, bool(self._row_features[slots].any())

    def advance(self) -> None:
        """After the last `metadata` call's rows sampled: their positions move on by one,
        on the device and in the host mirror."""
        assert self._last is not None, "advance() without a metadata() call"
        slots, index = self._last
        self._last = None
        self._device_ints[_POSITION].index_add_(0, index, torch.ones_like(index))
        self._ints[_POSITION, slots] += 1

    def _upload(self) -> None:
        """The whole host buffer to the device: one copy."""
        source = torch.from_numpy(self._host)
        if self.pin is None:
            self._device.copy_(source)
        else:  # a pinned copy of the bytes: the host arrays may change before it is done
            self._device.copy_(self.pin(source), non_blocking=True)
        self._dirty = False
        self.num_uploads += 1

    def _index_of(self, slot_list: list[int]) -> torch.Tensor:
        """The rows' slots on the device; uploaded only when they differ from the last."""
        if self._index is None or slot_list != self._index_key:
            values = torch.tensor(slot_list, dtype=torch.int64)
            if self.pin is None:
                self._index = values.to(self.device)
            else:
                self._index = self.pin(values).to(self.device, non_blocking=True)
            self._index_key = slot_list
        return self._index
