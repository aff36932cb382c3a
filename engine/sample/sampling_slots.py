"""Sampling parameters that persist across steps, one slot per request (a persistent batch,
as in vLLM v1): the sampler's per-row tensors are gathered from here, not rebuilt from Python
lists each step.

A request takes a slot the first step it samples and keeps it until it leaves (finished,
aborted or preempted: `drop`). Its values are written once into host arrays, which mirror a
device buffer of the same bytes; a step copies the whole buffer up (one copy, through pinned
memory where the runner pins, without waiting) only when some slot was written or the
batch's slots changed. The batch's rows are then gathered from the slots with an index
tensor and kept, as the batch's own tensors, until the next such step::

    host (numpy, one byte buffer)                      device (uint8, the same layout)
    ints   [3, capacity] int64    seed | top_k | position       ─┐ one copy, only in a step
    floats [6, capacity] float32  temperature | top_p | min_p |  ├ where a slot was written
                                  presence | frequency | repetition ─┘
    step:  index [B] (the rows' slots)  ->  ints[:, index], floats[:, index]  ->  metadata

The position (the output index of the token being sampled, the seeded sampler's counter)
moves every step: `advance` adds 1 to the batch's gathered positions on the device (one
in-place add) and to the slots' positions in the host mirror, so the two stay equal without
a copy (the device's per-slot positions are stale until the next upload, which writes the
host's). Each step the host compares the mirror with each row's true position (tokens so
far + placeholders in flight) and writes a slot that moved otherwise (a preempted request
recomputed, a migrated stream resumed, a request that took the greedy screen in between).

A request with a penalty also gets a row of token counts on the device
(engine/sample/penalty_state.py), built when it joins and counted by `advance`, where that
pays (`counts_penalties_on_device`); on the CPU its penalties are built from its token
lists each step (`add_row_features`), as before.

Values are stored as `SamplingMetadata.build` makes them (greedy rows get temperature 0 and
the filters off), so a row samples the same token either way. Only the host arrays are read
by the host (which filters any row uses, the largest top_k): never the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.api.sampling_params import SamplingParams, SamplingType
from engine.sample.metadata import SamplingMetadata, has_penalty, needs_row_features, to_int64
from engine.sample.penalty_state import PenaltyState

Pin = Callable[[torch.Tensor], torch.Tensor]
# Per row, in batch order: request id, parameters, seed, position of the token being sampled
# (output so far + tokens in flight), prompt token ids, output token ids (read only when a
# penalised row's counts are built).
SlotRow = tuple[str, SamplingParams, int, int, list[int], list[int]]

_SEED, _TOP_K, _POSITION = range(3)  # rows of the int64 block
_NUM_INTS = 3
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)  # float32 rows
_NUM_FLOATS = 6
# Each float row's "off" value: a row whose batch values all equal it is left out (None).
_OFF = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=np.float32).reshape(_NUM_FLOATS, 1)


def counts_penalties_on_device(device: str | torch.device) -> bool:
    """Whether penalised rows keep their token counts on the device (penalty_state.py): on
    an accelerator, where a step's [P, V] gather and dense penalty math take microseconds.
    Not on the CPU, where they cost more than the sparse lists rebuilt from the host's
    tokens (benchmarks/offline/sampling_metadata_time.py --penalties); there async
    scheduling falls back for penalty steps (engine/core/async_scheduling.py)."""
    return torch.device(device).type != "cpu"


class SamplingSlots:
    def __init__(
        self,
        device: torch.device,
        pin: Pin | None = None,
        capacity: int = 8,
        penalties_on_device: bool | None = None,
    ) -> None:
        """`pin` copies a host tensor into pinned memory (uploads then do not wait for the
        device); None uploads plainly. `penalties_on_device`: None decides by the device
        (`counts_penalties_on_device`); a CPU test passes True to run the GPU's way."""
        self.device = device
        self.pin = pin
        if penalties_on_device is None:
            penalties_on_device = counts_penalties_on_device(device)
        self.penalties_on_device = penalties_on_device
        self._held: dict[str, tuple[int, SamplingParams, int]] = {}  # id -> slot, params, seed
        self._free: list[int] = []
        self._capacity = 0
        self._dirty = False
        self._index_key: list[int] = []  # the slots `_index` holds, in batch order
        self._index: torch.Tensor | None = None  # [B] int64 on the device
        self._last: np.ndarray | None = None  # the last gather's slots
        # The batch's metadata fields, gathered at the last upload; its positions move on
        # in place (`advance`).
        self._batch: dict[str, Any] = {}
        self._batch_needs_rows = False
        self.penalties: PenaltyState | None = None  # made when a penalised request joins
        self._unfilled: set[int] = set()  # penalised slots whose counts are still to build
        # The static batch's penalised rows: (batch rows, their rows in `penalties`).
        self._penalty_index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last_penalty: tuple[torch.Tensor, torch.Tensor] | None = None
        self.num_uploads = 0  # copies of the buffer (index uploads not counted)
        self._grow(capacity)

    # ---- joining and leaving ---------------------------------------------------------

    def drop(self, request_ids: set[str]) -> None:
        """Gives back the slots of requests that finished, were aborted or preempted."""
        for request_id in request_ids:
            held = self._held.pop(request_id, None)
            if held is not None:
                self._free.append(held[0])
                self._release_penalty(held[0])

    def _release_penalty(self, slot: int) -> None:
        self._penalised[slot] = False
        self._unfilled.discard(slot)
        if self.penalties is not None:
            self.penalties.release(slot)

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
        penalty = has_penalty(params)
        self._row_features[slot] = needs_row_features(params) or (
            penalty and not self.penalties_on_device
        )
        self._release_penalty(slot)
        if penalty and self.penalties_on_device:
            self._penalised[slot] = True
            self._unfilled.add(slot)
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
        penalised = np.zeros(capacity, dtype=bool)
        if old:
            ints[:, :old] = self._ints
            floats[:, :old] = self._floats
            num_logprobs[:old] = self._num_logprobs
            row_features[:old] = self._row_features
            penalised[:old] = self._penalised
        self._host, self._ints, self._floats = host, ints, floats
        self._num_logprobs, self._row_features = num_logprobs, row_features
        self._penalised = penalised
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
        for request_id, params, seed, *_ in rows:
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
            self._unfilled.update(int(s) for s in slots[moved & self._penalised[slots]])
        if self._unfilled:
            self._fill_penalties(rows, slot_list, vocab_size)
        if self._index is None or slot_list != self._index_key:
            self._index = self._upload_ids(slot_list)
            self._index_key = slot_list
            self._dirty = True  # the device's per-slot positions are the host's again
        if self._dirty:
            self._upload()
            self._batch = self._gather(slots, self._index, vocab_size)
        self._last = slots
        metadata = SamplingMetadata(**self._batch)
        self._add_penalty_rows(metadata)
        return metadata, self._batch_needs_rows

    def _gather(self, slots: np.ndarray, index: torch.Tensor, vocab_size: int) -> dict[str, Any]:
        """The batch's metadata fields, gathered on the device, with the flags read from
        the host arrays."""
        ints = self._device_ints.index_select(1, index)  # [3, B]
        floats = self._device_floats.index_select(1, index)  # [6, B]
        host_floats = self._floats[:, slots]  # [6, B], the host's copy of the same values
        in_use = (host_floats != _OFF).any(axis=1)  # [6]: which rows a filter/penalty is on
        greedy = host_floats[_TEMPERATURE] == 0.0
        max_top_k = int(self._ints[_TOP_K, slots].max(initial=0))
        num_logprobs = int(self._num_logprobs[slots].max(initial=-1))
        self._batch_needs_rows = bool(self._row_features[slots].any())
        self._penalty_index = self._penalty_rows(slots)

        def used(row: int) -> torch.Tensor | None:
            return floats[row] if in_use[row] else None

        return dict(
            vocab_size=vocab_size,
            temperature=floats[_TEMPERATURE],
            all_greedy=not in_use[_TEMPERATURE],
            all_random=not bool(greedy.any()),
            seeds=ints[_SEED],
            positions=ints[_POSITION],  # moved on in place by `advance`
            top_k=ints[_TOP_K] if max_top_k else None,
            max_top_k=max_top_k,
            top_p=used(_TOP_P),
            min_p=used(_MIN_P),
            presence_penalties=used(_PRESENCE),
            frequency_penalties=used(_FREQUENCY),
            repetition_penalties=used(_REPETITION),
            max_num_logprobs=num_logprobs if num_logprobs >= 0 else None,
        )

    def advance(self, sampled_token_ids: torch.Tensor) -> None:
        """After the last `metadata` call's rows sampled `sampled_token_ids` ([B] on the
        device): their positions move on by one, on the device and in the host mirror, and
        the penalised rows count their token."""
        assert self._last is not None, "advance() without a metadata() call"
        self._batch["positions"].add_(1)  # [B], the batch's, on the device
        self._ints[_POSITION, self._last] += 1
        self._last = None
        if self._last_penalty is not None:
            assert self.penalties is not None
            batch_rows, state_rows = self._last_penalty
            self.penalties.count(state_rows, sampled_token_ids.index_select(0, batch_rows))
            self._last_penalty = None

    # ---- penalties (engine/sample/penalty_state.py) ------------------------------------

    def _fill_penalties(self, rows: Sequence[SlotRow], slot_list: list[int], vocab: int) -> None:
        """Builds the counts of the batch's penalised slots that joined or moved, from their
        token lists: every token must be on the host then (none in flight)."""
        if self.penalties is None:
            self.penalties = PenaltyState(self.device, vocab, self.pin)
        for row, slot in zip(rows, slot_list):
            if slot not in self._unfilled:
                continue
            request_id, _, _, position, prompt_token_ids, output_token_ids = row
            if position != len(output_token_ids):
                raise RuntimeError(
                    f"{request_id!r}: a penalised request's counts to build with tokens in "
                    "flight (its output on the host is not complete)"
                )
            self.penalties.fill(slot, prompt_token_ids, output_token_ids)
            self._unfilled.discard(slot)

    def _penalty_rows(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch's penalised rows and their rows in `penalties`, on the device (part of
        the static batch: a slot keeps its row until it is written again)."""
        batch_rows = np.flatnonzero(self._penalised[slots]).tolist()
        if not batch_rows:
            return None
        assert self.penalties is not None
        state_rows = [self.penalties.row(int(slots[i])) for i in batch_rows]
        return self._upload_ids(batch_rows), self._upload_ids(state_rows)  # type: ignore[arg-type]

    def _add_penalty_rows(self, metadata: SamplingMetadata) -> None:
        """The penalised rows' dense counts and prompt masks, gathered on the device."""
        self._last_penalty = self._penalty_index
        if self._penalty_index is None:
            return
        assert self.penalties is not None
        batch_index, state_index = self._penalty_index
        metadata.penalty_row_ids = batch_index
        metadata.penalty_counts = self.penalties.counts.index_select(0, state_index)
        metadata.penalty_prompt_mask = self.penalties.prompt_mask.index_select(0, state_index)

    def _upload(self) -> None:
        """The whole host buffer to the device: one copy."""
        source = torch.from_numpy(self._host)
        if self.pin is None:
            self._device.copy_(source)
        else:  # a pinned copy of the bytes: the host arrays may change before it is done
            self._device.copy_(self.pin(source), non_blocking=True)
        self._dirty = False
        self.num_uploads += 1

    def _upload_ids(self, values: list[int]) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.int64)
        if self.pin is None:
            return tensor.to(self.device)
        return self.pin(tensor).to(self.device, non_blocking=True)
