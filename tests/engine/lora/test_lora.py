"""LoRA building blocks against PEFT: adapters PEFT writes load with the deltas PEFT merges
(plain and rsLoRA scaling, any subset of q/k/v/o/gate/up/down), bad adapters are refused
with the reason, and the batched shrink/expand over a batch mixing the base model and three
adapters of different ranks gives each token what its adapter's merged layer gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.lora import LoRARequest
from engine.lora.adapter import linear_shapes, load_peft_adapter
from engine.lora.ops import add_lora, add_lora_reference, stack_lora_weights

# (rank, alpha, rsLoRA, target modules): three adapters of different ranks and targets.
ADAPTERS = {
    "attn-r4": (4, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r8": (8, 16, True, ["gate_proj", "up_proj", "down_proj"]),
    "mixed-r2": (2, 4, False, ["q_proj", "v_proj", "down_proj"]),
}


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def peft_adapter(directory: Path, name: str, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """Saves a random PEFT adapter; returns its path and the dense weights PEFT merges."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    rank, alpha, rslora, targets = ADAPTERS[name]
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_config())
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=targets,
        init_lora_weights=False,  # random B too: a zero update would prove nothing
    )
    model = get_peft_model(base, config)
    path = directory / name
    model.save_pretrained(str(path))
    merged = model.merge_and_unload().state_dict()
    deltas = {k: merged[k] - base_state[k] for k in base_state if k.endswith("proj.weight")}
    return path, {"base": base_state, **deltas}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora")
    return {name: peft_adapter(directory, name, seed) for seed, name in enumerate(ADAPTERS, 1)}


def module_key(layer: int, module: str) -> str:
    group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{group}.{module}.weight"


def test_lora_request() -> None:
    request = LoRARequest("sql", 1, "/adapters/sql")
    assert request.adapter_id == 1
    assert request == LoRARequest("sql", 2, "/elsewhere") and hash(request) == hash("sql")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("sql", 0, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/adapters/sql")


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_loaded_deltas_equal_peft_merged_weights(adapters, name) -> None:
    path, merged = adapters[name]
    rank, _, _, targets = ADAPTERS[name]
    adapter = load_peft_adapter(path, tiny_config(), max_lora_rank=8, name=name, int_id=3)
    assert (adapter.name, adapter.int_id, adapter.rank) == (name, 3, rank)
    assert set(adapter.target_modules) == set(targets)
    for layer in range(2):
        for module in linear_shapes(tiny_config()):
            weights = adapter.layer_weights(layer, module)
            delta = merged[module_key(layer, module)]
            if module not in targets:
                assert weights is None and torch.count_nonzero(delta) == 0
                continue
            assert weights is not None
            torch.testing.assert_close(weights.delta(), delta, atol=1e-5, rtol=1e-4)
            assert torch.count_nonzero(delta) > 0


def _rewrite_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    (dst / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    return dst


def test_bad_adapters_are_refused_with_the_reason(adapters, tmp_path) -> None:
    path = adapters["mlp-r8"][0]
    config = tiny_config()
    with pytest.raises(ValueError, match="rank 8 is greater than max_lora_rank=4"):
        load_peft_adapter(path, config, max_lora_rank=4)
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "adapter_config.json").write_bytes((path / "adapter_config.json").read_bytes())
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is missing"):
        load_peft_adapter(missing, config, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"adapter_config\.json is missing"):
        load_peft_adapter(tmp_path, config, max_lora_rank=8)
    with pytest.raises(ValueError, match="not a directory"):
        load_peft_adapter(tmp_path / "nowhere", config, max_lora_rank=8)
    head = _rewrite_config(path, tmp_path / "head", target_modules=["down_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"target_modules \['lm_head'\] are not supported"):
        load_peft_adapter(head, config, max_lora_rank=8)
    dora = _rewrite_config(path, tmp_path / "dora", use_dora=True)
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        load_peft_adapter(dora, config, max_lora_rank=8)
    # Tensors for modules the config does not list.
    narrow = _rewrite_config(path, tmp_path / "narrow", target_modules=["up_proj"])
    with pytest.raises(ValueError, match="not in target_modules"):
        load_peft_adapter(narrow, config, max_lora_rank=8)
    # An adapter trained for another model: shapes do not fit.
    other = tiny_config()
    other.intermediate_size = 64
    with pytest.raises(ValueError, match=r"layers\.0\.\w+_proj has lora_A"):
        load_peft_adapter(path, other, max_lora_rank=8)


@pytest.mark.parametrize("impl", [add_lora, add_lora_reference], ids=["grouped", "reference"])
@pytest.mark.parametrize("module", ["q_proj", "v_proj", "down_proj", "up_proj"])
def test_mixed_batch_equals_each_adapters_merged_layer(adapters, impl, module) -> None:
    """Tokens of the base model and of three adapters (ranks 4, 8, 2, padded to 8) in one
    call: each row equals x @ (W + delta_its_adapter)^T as PEFT merges it."""
    config = tiny_config()
    names = list(ADAPTERS)
    loaded = [load_peft_adapter(adapters[n][0], config, max_lora_rank=8) for n in names]
    out_features, in_features = linear_shapes(config)[module]
    layer = 1
    a, b = stack_lora_weights(
        [ad.layer_weights(layer, module) for ad in loaded], 8, out_features, in_features
    )
    generator = torch.Generator().manual_seed(0)
    indices = torch.tensor([-1, 0, 2, 1, 1, -1, 0, 2, 2, 1, -1, 0, 1])  # base = -1
    x = torch.randn(len(indices), in_features, generator=generator)
    base = adapters[names[0]][1]["base"][module_key(layer, module)]
    y = impl(x @ base.T, x, a, b, indices)
    for row, slot in enumerate(indices.tolist()):
        weight = base.clone()
        if slot >= 0:
            weight += adapters[names[slot]][1][module_key(layer, module)]
        torch.testing.assert_close(y[row], x[row] @ weight.T, atol=1e-4, rtol=1e-4)


def test_grouped_equals_reference_on_random_stacks() -> None:
    generator = torch.Generator().manual_seed(1)
    f64 = {"generator": generator, "dtype": torch.float64}  # the two sum orders agree to 1e-7
    num_slots, max_rank, in_features, out_features, num_tokens = 5, 16, 40, 24, 300
    a = torch.randn(num_slots, max_rank, in_features, **f64)
    b = torch.randn(num_slots, out_features, max_rank, **f64)
    indices = torch.randint(-1, num_slots, (num_tokens,), generator=generator)
    x = torch.randn(num_tokens, in_features, **f64)
    y0 = torch.randn(num_tokens, out_features, **f64)
    expected = add_lora_reference(y0.clone(), x, a, b, indices)
    torch.testing.assert_close(add_lora(y0.clone(), x, a, b, indices), expected)
    base_rows = indices < 0
    torch.testing.assert_close(expected[base_rows], y0[base_rows])  # -1: untouched
