"""A model's projections filled straight from a GGUF file's blocks (quantization="gguf").

The model is built on the meta device. Before it gets real storage, `install_gguf_blocks`
reads each projection's blocks from the file (engine/loader/gguf_blocks.py) into the matrix
its kernels use, gives the layer its quantized method, and leaves its `weight` an empty
meta parameter, so the later `to_empty` allocates only what stays in fp32 (norms, biases,
tensors the file stores unquantized). No fp32 copy of a projection ever exists::

    meta model ──install_gguf_blocks──▶ projections: QuantizedWeight (file bytes, once)
               ──to_empty + load_weights(skip=kept names)──▶ norms, biases from safetensors
               ──check_gguf_blocks──▶ sample rows of each kept tensor vs the fp32 cache

The check dequantizes 8 rows from the middle of every kept tensor (rows that llama's q/k
un-permutation moves: in a head of D rows only the first and the last stay in place) and
compares them with the same rows of the dequantized safetensors cache, read lazily
(`safe_open` slices), so a wrong name, layer or permutation fails at load without reading
the cache's fp32 weights. One small kernel call per tensor keeps it to milliseconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.quantization import (
    CPUQuantizedLinearMethod,
    QuantizedEmbedding,
    install_quantized,
    projection_layers,
)
from engine.loader.gguf_blocks import GGUFBlockTensor, gguf_block_tensors, read_blocks
from engine.loader.gguf_file import GGUFFile, read_gguf
from engine.native.quant import QuantizedWeight

# Rows compared per kept tensor, from its middle.
_CHECK_ROWS = 8


@dataclass(frozen=True)
class BlockCheck:
    """Checkpoint tensor `name` (file tensor `gguf_name`, `num_rows` rows) is rows
    [part_row, part_row + num_rows) of the quantized matrix `part`."""

    name: str
    gguf_name: str
    part: QuantizedWeight
    part_row: int
    num_rows: int


def install_gguf_blocks(
    model: nn.Module, gguf_file: Path, hf_config: Any, device: torch.device
) -> tuple[set[str], list[BlockCheck]]:
    """Gives every projection (and the embedding / LM head) whose tensors the file stores
    in blocks its quantized weight; `model` is still on meta. Returns the checkpoint names
    now filled (the fp32 loader skips them) and the checks `check_gguf_blocks` runs."""
    gguf = read_gguf(gguf_file)
    blocks = gguf_block_tensors(gguf, hf_config)
    packed = getattr(model, "packed_modules_mapping", {})
    kept: set[str] = set()
    checks: list[BlockCheck] = []
    for name, layer in projection_layers(model):
        prefix, _, leaf = name.rpartition(".")
        keys = [f"{prefix}.{member}.weight" for member in packed.get(leaf, (leaf,))]
        if not all(key in blocks for key in keys):
            continue  # stored unquantized (F32/F16) in the file: stays fp32
        _check_shapes(layer, [blocks[key] for key in keys])
        parts = _read_groups(gguf, [(key, blocks[key]) for key in keys], checks)
        install_quantized(layer, parts, device)
        kept.update(keys)
    _install_embedding_and_head(model, gguf, blocks, kept, checks)
    return kept, checks


def _check_shapes(layer: Linear, tensors: list[GGUFBlockTensor]) -> None:
    """Each member's [out, in] must be the rows the layer gives it."""
    sizes = (layer.out_features,) if len(tensors) == 1 else layer.output_sizes
    if sizes is None or len(sizes) != len(tensors):
        names = [tensor.info.name for tensor in tensors]
        raise ValueError(f"GGUF tensors {names} do not match the layer's parts {sizes}.")
    for tensor, rows in zip(tensors, sizes, strict=True):
        if (tensor.out_features, tensor.in_features) != (rows, layer.in_features):
            raise ValueError(
                f"GGUF tensor {tensor.info.name} has shape "
                f"{(tensor.out_features, tensor.in_features)}, the model expects "
                f"{(rows, layer.in_features)}."
            )


def _read_groups(
    gguf: GGUFFile, members: list[tuple[str, GGUFBlockTensor]], checks: list[BlockCheck]
) -> list[QuantizedWeight]:
    """Consecutive members of one block type read into one matrix (one kernel call)."""
    groups: list[list[tuple[str, GGUFBlockTensor]]] = []
    for key, tensor in members:
        if groups and groups[-1][0][1].qtype == tensor.qtype:
            groups[-1].append((key, tensor))
        else:
            groups.append([(key, tensor)])
    parts = []
    for group in groups:
        part = read_blocks(gguf, [tensor for _, tensor in group])
        row = 0
        for key, tensor in group:
            checks.append(BlockCheck(key, tensor.info.name, part, row, tensor.out_features))
            row += tensor.out_features
        parts.append(part)
    return parts


def _install_embedding_and_head(
    model: nn.Module,
    gguf: GGUFFile,
    blocks: dict[str, GGUFBlockTensor],
    kept: set[str],
    checks: list[BlockCheck],
) -> None:
    """The embedding table and the LM head as the file stores them (tied: one table)."""
    embed_name, head_name = "model.embed_tokens.weight", "lm_head.weight"
    decoder, lm_head = model.model, getattr(model, "lm_head", None)
    vocab, hidden = decoder.embed_tokens.weight.shape
    embed = None
    if embed_name in blocks:
        embed = _read_one(gguf, embed_name, blocks[embed_name], (vocab, hidden), checks)
        decoder.embed_tokens = QuantizedEmbedding(embed)
        kept.add(embed_name)
    if lm_head is not None and head_name in blocks:
        head = _read_one(gguf, head_name, blocks[head_name], tuple(lm_head.weight.shape), checks)
        model.quantized_logits = CPUQuantizedLinearMethod([head])
        lm_head.weight = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
        kept.add(head_name)
    elif lm_head is None and embed is not None:  # tied: the head is the embedding table
        model.quantized_logits = CPUQuantizedLinearMethod([embed])


def _read_one(
    gguf: GGUFFile,
    name: str,
    tensor: GGUFBlockTensor,
    shape: tuple[int, ...],
    checks: list[BlockCheck],
) -> QuantizedWeight:
    if (tensor.out_features, tensor.in_features) != shape:
        raise ValueError(
            f"GGUF tensor {tensor.info.name} has shape "
            f"{(tensor.out_features, tensor.in_features)}, the model expects {shape}."
        )
    weight = read_blocks(gguf, [tensor])
    checks.append(BlockCheck(name, tensor.info.name, weight, 0, tensor.out_features))
    return weight


def check_gguf_blocks(model_dir: Path, checks: list[BlockCheck]) -> None:
    """Sample rows of each kept tensor must dequantize to the fp32 cache's rows (up to the
    last bit: two dequantizations may round d * q + m differently)."""
    with _one_thread():
        _check_rows(model_dir, checks)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """A few rows are microseconds of work on one thread; forking the OpenMP team for each
    of 200 calls costs a millisecond each, tens on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_rows(model_dir: Path, checks: list[BlockCheck]) -> None:
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    handles = [safe_open(str(file), framework="pt", device="cpu") for file in files]
    where = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118
    for check in checks:
        if check.name not in where:
            raise ValueError(
                f"GGUF tensor {check.gguf_name} is {check.name}, which the dequantized "
                f"checkpoint in {model_dir} does not have."
            )
        start = max(0, min(check.num_rows // 2, check.num_rows - _CHECK_ROWS))
        end = min(start + _CHECK_ROWS, check.num_rows)
        expected = where[check.name].get_slice(check.name)[start:end].float()  # [rows, in]
        row = check.part_row + start
        _compare(check, expected, check.part.dequantize(row, row + end - start))


def _compare(check: BlockCheck, expected: torch.Tensor, actual: torch.Tensor) -> None:
    if expected.shape != actual.shape:
        raise ValueError(
            f"GGUF tensor {check.gguf_name}: rows of shape {tuple(actual.shape)}, the "
            f"checkpoint's {check.name} has {tuple(expected.shape)}."
        )
    tolerance = 1e-5 * (expected.abs().max().item() + 1e-12)
    error = (actual - expected).abs().max().item()
    if not error <= tolerance:  # also catches NaN
        raise ValueError(
            f"GGUF tensor {check.gguf_name} does not match the dequantized {check.name} "
            f"(max error {error:.3g} on sampled rows): wrong name or row order."
        )
