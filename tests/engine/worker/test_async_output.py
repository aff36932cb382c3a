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
from engine.worker.uploads import Uploader, make_uploader


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
    step = _inputs([0, 0, 7, 8, 9], [0, 1, 2, 5])
    pinned: list[list[int]] = []
    upload = Uploader(torch.device("cpu"), pinned=True, pin=_recording_pin(pinned))
    inputs.fill(batch, step, upload)
    assert step.input_ids.tolist() == [13, 11, 7, 8, 9]
    assert pinned == [[0, 1], [2, 0]]  # the index lists went up through pinned memory


def test_a_placeholder_without_a_sampled_id_is_an_error() -> None:
    inputs = PlaceholderInputs()
    inputs.remember([([_entry("a")], torch.tensor([4]))])
    upload = Uploader(torch.device("cpu"), pinned=False)
    with pytest.raises(RuntimeError, match="'b'"):
        inputs.fill([_entry("b", 1)], _inputs([0], [0, 1]), upload)
    inputs.remember([])
    with pytest.raises(RuntimeError, match="'a'"):
        inputs.fill([_entry("a", 1)], _inputs([0], [0, 1]), upload)


def _inputs(input_ids: list[int], query_start_loc: list[int]) -> Any:
    return SimpleNamespace(
        input_ids=torch.tensor(input_ids, dtype=torch.int64), query_start_loc_cpu=query_start_loc
    )


def _recording_pin(log: list[list[int]]) -> Any:
    def pin(tensor: torch.Tensor) -> torch.Tensor:
        log.append(tensor.tolist())
        return tensor.clone()  # a copy, as pinning makes one

    return pin


def test_step_inputs_uploaded_through_pinned_memory_equal_direct_ones() -> None:
    """The GPU's path (pinned, non-blocking) with a stand-in pin: every tensor of the step's
    inputs goes through it, and the inputs equal those built on the device directly."""
    requests = [([5], 9, [3, 1]), ([6, 7, 8], 0, [2])]
    direct = Uploader(torch.device("cpu"), pinned=False).step_inputs(requests, 8, None)
    pinned: list[list[int]] = []
    uploader = Uploader(torch.device("cpu"), pinned=True, pin=_recording_pin(pinned))
    moved = uploader.step_inputs(requests, 8, None)
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(moved, name), getattr(direct, name))
    metadata, expected = moved.attn_metadata, direct.attn_metadata
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(metadata, name), getattr(expected, name)), name
        assert getattr(metadata, name).dtype == getattr(expected, name).dtype
    assert len(pinned) == 6  # ids, positions and the four metadata tensors
    assert metadata.query_start_loc_cpu == expected.query_start_loc_cpu
    assert uploader([4, 2], torch.int64).tolist() == [4, 2] and pinned[-1] == [4, 2]


def test_uploads_are_pinned_only_for_async_scheduling_on_a_gpu() -> None:
    assert make_uploader(torch.device("cuda"), async_scheduling=True).pin is not None
    assert make_uploader(torch.device("cuda"), async_scheduling=False).pin is None
    assert make_uploader(torch.device("cpu"), async_scheduling=True).pin is None
