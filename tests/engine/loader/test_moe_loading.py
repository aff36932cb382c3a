"""Loading mixture-of-experts checkpoints: the Hub's per-expert tensors and transformers 5's
stacked ones fill the same parameters; a missing expert tensor is named; quantization is
refused for MoE models rather than half applied."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.api.model_files import load_hf_config
from engine.attention.torch_backend import TorchAttentionBackend
from engine.loader.model_loader import load_model
from tests.model_utils import make_tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return make_tiny_model(path, "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)


def _load(path):
    return load_model(path, load_hf_config(path), torch.float32, CPU, TorchAttentionBackend())


def _rewrite(src, dst, tensors):
    dst.mkdir()
    for file in src.iterdir():
        if file.name != "model.safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    save_file(tensors, dst / "model.safetensors")


def test_per_expert_and_stacked_checkpoints_load_alike(tiny_mixtral, tmp_path):
    tensors = load_file(tiny_mixtral / "model.safetensors")
    stacked = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            stacked[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        experts = range(4)
        w1 = [tensors[f"{prefix}.{e}.w1.weight"] for e in experts]
        w3 = [tensors[f"{prefix}.{e}.w3.weight"] for e in experts]
        gate_up = torch.stack([torch.cat((a, b)) for a, b in zip(w1, w3)])
        down = torch.stack([tensors[f"{prefix}.{e}.w2.weight"] for e in experts])
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    _rewrite(tiny_mixtral, tmp_path / "stacked", stacked)
    ours, theirs = _load(tiny_mixtral), _load(tmp_path / "stacked")
    moe = ours.model.layers[1].mlp
    assert moe.w13_weight.shape == (4, 2 * 128, 64)
    # Expert 2's up rows are its w3, below the gate rows.
    prefix = "model.layers.1.block_sparse_moe.experts.2"
    assert torch.equal(moe.w13_weight[2, 128:], tensors[f"{prefix}.w3.weight"])
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), name


def test_a_missing_expert_tensor_is_named(tiny_mixtral, tmp_path):
    tensors = load_file(tiny_mixtral / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.3.w3.weight"]
    _rewrite(tiny_mixtral, tmp_path / "missing", tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.w13_weight\[\(3, 1\)\]"):
        _load(tmp_path / "missing")


def test_quantization_is_refused_for_moe(tiny_mixtral):
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        LLM(model=str(tiny_mixtral), quantization="int8", max_model_len=64)
