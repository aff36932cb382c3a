"""Loading with quantization="gguf": the header reader against gguf-py's, no fp32 copy of a
projection ever made (every tensor the loader creates is watched), and files with a wrong
shape, swapped tensors or missing blocks refused with the tensor's name."""

from __future__ import annotations

import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.api.model_files import default_model_path, load_hf_config
from engine.attention.backend import get_attention_backend
from engine.loader.gguf_file import read_gguf
from engine.loader.model_dir import resolve_model
from engine.loader.model_loader import load_model
from engine.models.decoder import DecoderForCausalLM
from engine.native import native_kernels_available
from tests.engine.gguf_files import HIDDEN, NUM_HEADS, NUM_KV_HEADS
from tests.engine.layers.test_quantization import _SCALES

pytestmark = pytest.mark.skipif(
    not native_kernels_available(), reason="no C compiler: native kernels unavailable"
)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tokenizer_fields) -> tuple[Path, Path]:
    """(the tiny llama GGUF file, its dequantized cache directory)."""
    from tests.engine.gguf_files import write_tiny_llama_gguf

    root = tmp_path_factory.mktemp("gguf")
    path = write_tiny_llama_gguf(root / "tiny.gguf", tokenizer_fields, _SCALES)
    return path, resolve_model(path, cache_dir=root / "cache")


class _LargestFloatTensor(TorchDispatchMode):
    """Records the largest floating-point tensor with new storage that any op creates while
    it is active (views, such as those of a memory-mapped safetensors file, allocate none)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        shared = {
            a.untyped_storage().data_ptr()
            for a in leaves
            if isinstance(a, torch.Tensor) and a.device.type != "meta" and not a.is_mkldnn
        }
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if not _real(tensor):
                continue
            # A oneDNN-layout copy (engine/layers/linear_select.py) is opaque: always new.
            if tensor.is_mkldnn or tensor.untyped_storage().data_ptr() not in shared:
                self.largest = max(self.largest, tensor.numel())
        return out


def _real(tensor: object) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.is_floating_point()
        and tensor.device.type != "meta"
    )


def _load(model_dir: Path, gguf_file: Path, quantization: str | None) -> tuple[object, int]:
    """load_model as the runner calls it: (the model, the largest fp32 tensor made). The
    greedy screen's packing of the LM head is left out: its per-block scales are a float
    tensor of 1/32 of the head's values, and tests/kernels/test_greedy_screen.py checks that
    it never dequantizes more than a few rows of the head at a time."""
    hf_config = load_hf_config(model_dir)
    device = torch.device("cpu")
    watch = _LargestFloatTensor()
    no_screen = mock.patch.object(DecoderForCausalLM, "_build_greedy_screen", return_value=None)
    with watch, no_screen:
        model = load_model(
            model_dir,
            hf_config,
            torch.float32,
            device,
            get_attention_backend(None, device),
            quantization=quantization,
            gguf_file=gguf_file,
        )
    return model, watch.largest


def test_header_reader_matches_gguf_py(tiny_gguf) -> None:
    from gguf import GGUFReader

    path, _ = tiny_gguf
    ours, theirs = read_gguf(path), GGUFReader(path)
    assert ours.architecture == "llama"
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert (info.ggml_type, info.offset) == (int(tensor.tensor_type), tensor.data_offset)
        assert info.nbytes == tensor.n_bytes
    for name, field in theirs.fields.items():
        if not name.startswith("GGUF.") and len(field.types) == 1:  # scalars and strings
            assert ours.metadata[name] == pytest.approx(field.contents()), name


def test_gguf_load_makes_no_fp32_projection(tiny_gguf) -> None:
    """The loader never creates a float tensor as large as the smallest projection (k, v:
    [kv_rows, hidden]); the fp32 load of the same file does, which shows the watch works."""
    path, model_dir = tiny_gguf
    smallest_projection = NUM_KV_HEADS * (HIDDEN // NUM_HEADS) * HIDDEN
    model, largest = _load(model_dir, path, "gguf")
    assert largest < smallest_projection
    assert all(p.numel() <= HIDDEN for p in model.parameters())  # the norms alone
    _, largest_fp32 = _load(model_dir, path, None)
    assert largest_fp32 >= smallest_projection


@pytest.mark.slow
def test_default_model_gguf_load_makes_no_fp32_projection() -> None:
    """SmolLM2: every projection, the embedding and the tied head stay as stored."""
    path = default_model_path()
    model, largest = _load(resolve_model(None), path, "gguf")
    assert largest < 192 * 576  # k/v projections: 3 heads x 64 rows of 576
    assert sum(p.numel() for p in model.parameters()) == (2 * 30 + 1) * 576  # norms
    assert model.quantized_logits is not None


def _patched(path: Path, out: Path, *edits: tuple[bytes, bytes]) -> Path:
    """A copy of the file with each `old` (found once, in the header) replaced by `new` of
    the same length, in order."""
    data = bytearray(path.read_bytes())
    for old, new in edits:
        assert len(old) == len(new) and data.count(old) == 1
        start = data.index(old)
        data[start : start + len(old)] = new
    out.write_bytes(bytes(data))
    return out


def test_wrong_shape_in_the_file_is_refused(tiny_gguf, tmp_path) -> None:
    path, model_dir = tiny_gguf
    # blk.0.attn_k.weight's dims (u32 count, u64 in, u64 rows): its 128 rows claimed as 64.
    head = b"blk.0.attn_k.weight" + (2).to_bytes(4, "little") + HIDDEN.to_bytes(8, "little")
    rows = NUM_KV_HEADS * HIDDEN // NUM_HEADS
    edit = (head + rows.to_bytes(8, "little"), head + (rows // 2).to_bytes(8, "little"))
    bad = _patched(path, tmp_path / "bad.gguf", edit)
    with pytest.raises(ValueError, match=r"GGUF tensor blk\.0\.attn_k\.weight has shape"):
        _load(model_dir, bad, "gguf")


def test_swapped_tensors_are_refused(tiny_gguf, tmp_path) -> None:
    """Layer 0's and layer 1's ffn_gate swapped: same shape, so only the row check against
    the dequantized checkpoint can tell."""
    path, model_dir = tiny_gguf
    swapped = _patched(
        path,
        tmp_path / "swapped.gguf",
        (b"blk.0.ffn_gate", b"blk.x.ffn_gate"),
        (b"blk.1.ffn_gate", b"blk.0.ffn_gate"),
        (b"blk.x.ffn_gate", b"blk.1.ffn_gate"),
    )
    with pytest.raises(ValueError, match=r"GGUF tensor blk\.0\.ffn_gate\.weight does not match"):
        _load(model_dir, swapped, "gguf")


def test_truncated_file_is_refused(tiny_gguf, tmp_path) -> None:
    path, _ = tiny_gguf
    truncated = tmp_path / "truncated.gguf"
    shutil.copyfile(path, truncated)
    with open(truncated, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    last = list(read_gguf(path).tensors)[-1]
    with pytest.raises(ValueError, match=f"GGUF tensor {last}.*runs past the end"):
        read_gguf(truncated)


def test_level_2_sleep_reloads_the_blocks(tiny_gguf, monkeypatch) -> None:
    """Waking from sleep(level=2) rebuilds the model as at start-up: still quantized, same
    tokens (it was reloaded as fp32 before, which the default now is not)."""
    from engine import LLM, SamplingParams

    path, model_dir = tiny_gguf
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(model_dir.parent))  # reuse the conversion
    llm = LLM(model=str(path), kv_cache_memory_bytes=8 * 2**20)
    assert llm.llm_engine.get_model_config().model_dir == model_dir
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 33, 9]}]

    def tokens() -> list[int]:
        return list(llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)

    reference = tokens()
    llm.sleep(level=2)
    llm.wake_up()
    model = llm.llm_engine.runner.model
    assert model.quantized_logits is not None
    assert all(p.numel() <= HIDDEN for p in model.parameters())
    assert tokens() == reference
