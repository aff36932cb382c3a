"""The pread-based safetensors reader against the safetensors library, and its errors."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader.safetensors_reader import read_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b.f32": torch.randn(7, 5, generator=g),
        "a.bf16": torch.randn(3, 64, generator=g).to(torch.bfloat16),
        "c.f16": torch.randn(33, generator=g).to(torch.float16),
        "d.i64": torch.randint(-(2**40), 2**40, (4, 2), generator=g),
        "e.bool": torch.rand(9, generator=g) > 0.5,
        "f.scalar": torch.tensor(3.5),
        "g.empty": torch.empty(0, 8),
        "h.u8": torch.randint(0, 256, (17,), dtype=torch.uint8, generator=g),
    }


def test_reads_what_the_library_reads(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    ours = dict(read_safetensors(path))
    with safe_open(str(path), framework="pt") as f:
        theirs = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert list(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


def test_skipped_names_are_not_returned(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path))
    assert set(dict(read_safetensors(path, skip={"b.f32", "h.u8"}))) == set(_tensors()) - {
        "b.f32",
        "h.u8",
    }


def _write_raw(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "w"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "w"),
        ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, "w"),
    ],
    ids=["truncated", "offsets-vs-shape", "unknown-dtype"],
)
def test_malformed_files_name_the_tensor(tmp_path, header, data, message):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, data)
    with pytest.raises(ValueError, match=f"'{message}'"):
        list(read_safetensors(path))


def test_header_longer_than_the_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        list(read_safetensors(path))
