"""The started host copy (engine/worker/async_output.py) and the placeholder rows' ids
taken on the device (engine/worker/placeholder_inputs.py). The GPU's pinned-memory and
event path runs here with a plain allocator and a recording event."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.worker.async_output import PinnedEventCopy, SyncCopy, make_host_copy
from engine.worker.host_reads import StepReads
from engine.worker.placeholder_inputs import PlaceholderInputs


class RecordingEvent:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def test_pinned_event_copy_waits_on_its_event_before_reading() -> None:
    log: list[str] = []
    buffers: list[torch.Tensor] = []

    def alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
        log.append("alloc")
        buffers.append(torch.full((numel,), -1, dtype=dtype))
        return buffers[-1]

    copy = PinnedEventCopy(alloc=alloc, make_event=lambda: RecordingEvent(log))
    reads = StepReads()
    ids = reads.add(torch.tensor([5, 7, 2**40]))
    top = reads.add(torch.tensor([[0.25, -1.5], [3.0, 0.125], [1.0, 2.0]]))
    first = reads.start(copy)
    second = StepReads()
    second.add(torch.tensor([9]))
    pending_second = second.start(copy)  # a second step in flight: its own buffer
    assert log == ["alloc", "record", "alloc", "record"]
    assert buffers[0].data_ptr() != buffers[1].data_ptr()
    host = first.wait()
    assert log[-1] == "synchronize"
    assert host[ids] == [5, 7, 2**40] and type(host[ids][0]) is int
    assert host[top] == [[0.25, -1.5], [3.0, 0.125], [1.0, 2.0]]
    assert pending_second.wait() == [[9]]


def test_host_copy_by_device() -> None:
    assert isinstance(make_host_copy(torch.device("cpu")), SyncCopy)
    assert isinstance(make_host_copy(torch.device("cuda")), PinnedEventCopy)  # nothing allocated
    reads = StepReads()
    reads.add(torch.tensor([3, 4]))
    assert reads.start(SyncCopy()).wait() == reads.read() == [[3, 4]]
    assert StepReads().start(SyncCopy()).wait() == []


def _entry(request_id: str, placeholders: int = 0) -> Any:
    return SimpleNamespace(request_id=request_id, num_placeholder_inputs=placeholders)


def test_placeholder_rows_take_the_previous_steps_ids() -> None:
    inputs = PlaceholderInputs()
    # step N sampled: a greedy-screen group [a, b] and a sampler group [c]
    inputs.remember(
        [([_entry("a"), _entry("b")], torch.tensor([11, 12])), ([_entry("c")], torch.tensor([13]))]
    )
    # step N+1: c and a are placeholders (one token each), p is a 3-token prefill chunk
    batch = [_entry("c", 1), _entry("a", 1), _entry("p")]
    input_ids = torch.tensor([0, 0, 7, 8, 9])
    inputs.fill(batch, input_ids, [0, 1, 2, 5])
    assert input_ids.tolist() == [13, 11, 7, 8, 9]


def test_a_placeholder_without_a_sampled_id_is_an_error() -> None:
    inputs = PlaceholderInputs()
    inputs.remember([([_entry("a")], torch.tensor([4]))])
    with pytest.raises(RuntimeError, match="'b'"):
        inputs.fill([_entry("b", 1)], torch.zeros(1, dtype=torch.int64), [0, 1])
    inputs.remember([])
    with pytest.raises(RuntimeError, match="'a'"):
        inputs.fill([_entry("a", 1)], torch.zeros(1, dtype=torch.int64), [0, 1])
