"""Async scheduling on the device: placeholder rows take their input ids from the previous
step's sampled ids, which never leave the device (engine/core/async_scheduling.py).

    step N   sampled ids  [a b c]  for requests  [r1 r2 r3]      (kept here, on the device)
    step N+1 input ids    [0 0 x ...]  r1, r2 are placeholders:  input_ids[[0, 1]] = [a b]

The scheduler schedules a placeholder only for a request that sampled in the step launched
just before (the engine collects that step before scheduling another otherwise), so one
step's ids are all this keeps.
"""

from __future__ import annotations

import torch

from engine.core.sched_output import ScheduledRequest
from engine.worker.inputs import StepInputs
from engine.worker.uploads import Uploader


class PlaceholderInputs:
    def __init__(self) -> None:
        self._ids: torch.Tensor | None = None  # [num_sampled] int64, the last step's
        self._rows: dict[str, int] = {}  # request id -> its row in _ids

    def remember(self, groups: list[tuple[list[ScheduledRequest], torch.Tensor]]) -> None:
        """Keeps a launched step's sampled ids (groups of entries with their ids)."""
        if not groups:
            self._ids, self._rows = None, {}
            return
        rows: dict[str, int] = {}
        for entries, _ in groups:
            for entry in entries:
                rows[entry.request_id] = len(rows)
        self._rows = rows
        tensors = [ids.reshape(-1).to(torch.int64) for _, ids in groups]
        self._ids = tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    def fill(self, batch: list[ScheduledRequest], inputs: StepInputs, upload: Uploader) -> None:
        """Writes each placeholder row's input id (in `inputs.input_ids`, on the device) from
        the last step's sampled ids: one gather and one scatter for the whole batch, no host
        read; the two index lists go up with `upload` (engine/worker/uploads.py)."""
        query_start_loc = inputs.query_start_loc_cpu  # [len(batch) + 1]
        dst: list[int] = []
        src: list[int] = []
        for i, entry in enumerate(batch):
            if not entry.num_placeholder_inputs:
                continue
            if entry.num_placeholder_inputs != 1 or entry.request_id not in self._rows:
                raise RuntimeError(
                    f"{entry.request_id!r}: a placeholder input without the previous step's "
                    "sampled id (async scheduling keeps one step in flight ahead)"
                )
            dst.append(query_start_loc[i + 1] - 1)
            src.append(self._rows[entry.request_id])
        if not dst:
            return
        assert self._ids is not None
        dst_index, src_index = upload(dst, torch.int64), upload(src, torch.int64)
        inputs.input_ids.index_copy_(0, dst_index, self._ids.index_select(0, src_index))
