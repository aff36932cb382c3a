"""A GGUF file's header read in milliseconds: scalar metadata and tensor descriptions.

gguf-py's `GGUFReader` builds a numpy view for every part of every metadata field; for a
file carrying a 49k-token vocabulary and its merges that takes seconds (≈ 7 s for the
default model on a loaded 2-core machine), and the engine needs none of those arrays. This
reader walks the same layout (GGUF v2/v3, little-endian) and keeps only what loading uses::

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x   (string key, u32 value type, value)       arrays: u32 type, u64 count, items
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 ggml
                    type, u64 offset into the data section)
    padding to `general.alignment` (32 by default), then the data section

Array values are skipped (their length is kept); tensor bytes are read on demand with
`read_into`, straight into the caller's buffer, so nothing of the file stays resident.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of one scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's description; `shape` is [rows, row_values] (outermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int  # 0 where the type's block size is unknown to `type_nbytes`


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # scalars and strings; arrays as ("array", count)
    tensors: dict[str, GGUFTensorInfo]
    file_size: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Copies tensor `name`'s bytes into `out` (C-contiguous, exactly its size)."""
        info = self.tensors[name]
        view = memoryview(out).cast("B")
        if view.nbytes != info.nbytes or not out.flags.c_contiguous:
            raise ValueError(
                f"buffer of {view.nbytes} bytes for GGUF tensor {name} ({info.nbytes})."
            )
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < info.nbytes:
                count = os.preadv(f.fileno(), [view[done:]], info.offset + done)
                if count <= 0:
                    raise ValueError(f"GGUF tensor {name}: the file ends inside its data.")
                done += count


class _Cursor:
    def __init__(self, data: bytes | mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        length = self.take("Q")
        value = self.data[self.pos : self.pos + length]
        if len(value) != length:
            raise struct.error("a string runs past the end of the file")
        self.pos += length
        return bytes(value).decode("utf-8", errors="replace")

    def skip_array(self, item_type: int, count: int) -> None:
        if item_type == _STRING:
            for _ in range(count):
                self.pos += 8 + struct.unpack_from("<Q", self.data, self.pos)[0]
        elif item_type == _ARRAY:
            for _ in range(count):
                self.skip_array(self.take("I"), self.take("Q"))
        else:
            self.pos += count * struct.calcsize("<" + _SCALARS[item_type])

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.take("I"), self.take("Q")
            self.skip_array(item_type, count)
            return ("array", count)
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {value_type}.")
        return self.take(_SCALARS[value_type])


def type_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` in `ggml_type` (0 where the type is not one we know)."""
    # native.quant loads torch; reading a header does not need it
    from engine.native.quant import BLOCK_SIZES, QType

    sizes = {0: (1, 4), 1: (1, 2)}  # F32, F16
    sizes.update({int(t): BLOCK_SIZES[t] for t in QType if t != QType.INT8})
    if ggml_type not in sizes:
        return 0
    block_values, block_bytes = sizes[ggml_type]
    numel = int(np.prod(shape)) if shape else 1
    return numel // block_values * block_bytes


def _check_row_blocks(name: str, shape: tuple[int, ...], ggml_type: int) -> None:
    """A row of a block type must hold whole blocks."""
    from engine.native.quant import BLOCK_SIZES, QType

    if ggml_type in {int(t) for t in QType if t != QType.INT8} and shape:
        block_values = BLOCK_SIZES[QType(ggml_type)][0]
        if shape[-1] % block_values:
            raise ValueError(
                f"GGUF tensor {name}: rows of {shape[-1]} values are not whole "
                f"{QType(ggml_type).name} blocks of {block_values}."
            )


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parses the header of the GGUF file at `path`; ValueError on a malformed one."""
    path = Path(path)
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic).")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3).")
        # Parsed through a mapping: only the header's pages are read, never the tensors.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            cursor = _Cursor(mapped)
            cursor.pos = 24
            try:
                metadata = {}
                for _ in range(num_kv):
                    key = cursor.string()
                    metadata[key] = cursor.value(cursor.take("I"))
                raw = []
                for _ in range(num_tensors):
                    name = cursor.string()
                    dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
                    raw.append((name, dims[::-1], cursor.take("I"), cursor.take("Q")))
            except struct.error as error:
                raise ValueError(f"{path}: the GGUF header is truncated ({error}).") from None
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in raw:
        _check_row_blocks(name, shape, ggml_type)
        info = GGUFTensorInfo(
            name, shape, ggml_type, data_start + offset, type_nbytes(ggml_type, shape)
        )
        if info.offset + info.nbytes > file_size:
            raise ValueError(
                f"GGUF tensor {name} ({info.nbytes} bytes at {info.offset}) runs past the end "
                f"of {path} ({file_size} bytes): the file is truncated or its header is wrong."
            )
        tensors[name] = info
    return GGUFFile(path, metadata, tensors, file_size)
