"""Pooling in the model runner: LAST, MEAN or CLS over a prompt's final normed hidden
states, across however many steps the prompt is computed in.

With chunked prefill a prompt's tokens arrive over several steps, so MEAN and CLS keep a
per-request accumulator between steps::

    prompt      t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9        (three chunks)
    MEAN        sum += h0..h3  sum += h4..h7  sum += h8,h9 -> sum / 10
    CLS         first = h0     -              -            -> first
    LAST        -              -              h9           -> h9

An accumulator starts at a chunk with `num_computed_tokens == 0` and must continue exactly
where the previous chunk ended; it is dropped when the request is pooled, finishes, is
aborted or preempted (a preempted request is recomputed from token 0). MEAN and CLS
requests take no prefix-cache hit (`PoolingParams.skip_reading_prefix_cache`), so every
prompt token passes through here. The pooled vector is cut to `dimensions`, then
L2-normalised where asked, and handed back as float32 on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config.pooler import POOLING_TYPES
from engine.core.sched_output import ModelRunnerOutput, ScheduledRequest
from engine.worker.inputs import StepInputs


@dataclass(slots=True)
class _Accumulator:
    """What a MEAN/CLS request has pooled so far (float32, on the model's device)."""

    num_tokens: int  # prompt tokens seen so far: the next chunk starts here
    total: torch.Tensor  # [hidden_size]: MEAN, the sum of the rows; CLS, the first row


class Pooler:
    """The engine's pooling type and the accumulators of requests pooled over several
    steps."""

    def __init__(self, pooling_type: str) -> None:
        assert pooling_type in POOLING_TYPES, pooling_type
        self.pooling_type = pooling_type
        self._accumulators: dict[str, _Accumulator] = {}

    def __len__(self) -> int:
        return len(self._accumulators)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forgets requests that finished, were aborted or preempted."""
        for request_id in request_ids:
            self._accumulators.pop(request_id, None)

    def __call__(
        self,
        batch: list[ScheduledRequest],
        rows: list[int],
        inputs: StepInputs,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Pools the scheduled pooling requests `rows` of `batch` (every chunk, not only
        the last); writes the vector of each request whose prompt completes to `output`.
        hidden: [num_tokens, hidden_size], rows laid out by `inputs.query_start_loc_cpu`."""
        starts = [inputs.query_start_loc_cpu[i] for i in rows]
        ends = [inputs.query_start_loc_cpu[i + 1] for i in rows]
        if self.pooling_type == "LAST":
            done = [j for j, i in enumerate(rows) if batch[i].pools]
            if not done:
                return
            index = torch.tensor([ends[j] - 1 for j in done], device=hidden.device)
            pooled = hidden[index].float()  # [num_done, hidden_size]
            self._finish([batch[rows[j]] for j in done], pooled, output)
            return
        chunk = self._chunk_totals(hidden, starts, ends)  # [num_rows, hidden_size]
        done_entries: list[ScheduledRequest] = []
        done_vectors: list[torch.Tensor] = []
        for j, i in enumerate(rows):
            entry = batch[i]
            total = self._accumulate(entry, chunk[j])
            if entry.pools:
                self._accumulators.pop(entry.request_id, None)
                if self.pooling_type == "MEAN":
                    total = total / entry.request.num_prompt_tokens
                done_entries.append(entry)
                done_vectors.append(total)
        if done_entries:
            self._finish(done_entries, torch.stack(done_vectors), output)

    def _chunk_totals(
        self, hidden: torch.Tensor, starts: list[int], ends: list[int]
    ) -> torch.Tensor:
        """Per row: the sum of its chunk's hidden states (MEAN) or its first one (CLS)."""
        if self.pooling_type == "CLS":
            return hidden[torch.tensor(starts, device=hidden.device)].float()
        lengths = torch.tensor([e - s for s, e in zip(starts, ends)], device=hidden.device)
        index = torch.cat([torch.arange(s, e, device=hidden.device) for s, e in zip(starts, ends)])
        segment = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), lengths)
        sums = torch.zeros(len(starts), hidden.shape[1], device=hidden.device)
        return sums.index_add_(0, segment, hidden[index].float())  # [num_rows, hidden_size]

    def _accumulate(self, entry: ScheduledRequest, chunk_total: torch.Tensor) -> torch.Tensor:
        """Adds one chunk to the request's accumulator; returns the total so far."""
        start = entry.num_computed_tokens
        if start == 0:  # a new request, or one recomputed after preemption
            state = _Accumulator(0, chunk_total)
        else:
            state = self._accumulators.get(entry.request_id)
            assert state is not None and state.num_tokens == start, (
                f"{entry.request} resumes at token {start}, but its pooling accumulator is at "
                f"{None if state is None else state.num_tokens}: a {self.pooling_type} request "
                "must compute every prompt token in order"
            )
            if self.pooling_type == "MEAN":
                state.total = state.total + chunk_total
        state.num_tokens = start + entry.num_new_tokens
        self._accumulators[entry.request_id] = state
        return state.total

    @staticmethod
    def _finish(
        entries: list[ScheduledRequest], pooled: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        """Cuts each vector to its `dimensions`, L2-normalises where asked, and hands it
        back as float32 on the CPU. pooled: [len(entries), hidden_size] float32."""
        for entry, vector in zip(entries, pooled.cpu().unbind(0)):
            params = entry.request.pooling_params
            assert params is not None
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if params.normalize:
                vector = F.normalize(vector, p=2.0, dim=-1)
            output.pooled[entry.request_id] = vector.clone()  # [dimensions or hidden_size]
