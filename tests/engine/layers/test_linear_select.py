"""fp32 linear layers chosen by measurement (engine/layers/linear_select.py): every method
against `F.linear`, the choice rules, the JSON cache round trip and the forced method."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from engine.api.model_files import CACHE_DIR_ENV, load_hf_config
from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers import linear_select
from engine.layers.linear import Linear
from engine.layers.linear_select import (
    LINEAR_METHOD_ENV,
    METHODS,
    choose_methods,
    forced_methods,
    make_plan,
    method_available,
    select_methods,
)
from engine.layers.method_cache import cache_file, cache_key
from engine.layers.row_buckets import ROW_BUCKETS
from engine.loader.model_loader import load_model
from tests.model_utils import make_tiny_llama

AVAILABLE = [m for m in METHODS if method_available(m)]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test measures into its own cache root, with no method forced."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(LINEAR_METHOD_ENV, raising=False)


@pytest.mark.parametrize("method", AVAILABLE)
@pytest.mark.parametrize("out_features,in_features", [(96, 40), (37, 64), (130, 33)])
def test_every_method_matches_f_linear(method, out_features, in_features):
    gen = torch.Generator().manual_seed(out_features * in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    plan = make_plan(weight, forced_methods(method))
    for rows in (1, 2, 3, 5, 8, 9, 31, 64, 129, 300):
        x = torch.randn(rows, in_features, generator=gen)
        torch.testing.assert_close(
            plan(x, weight, bias), F.linear(x, weight, bias), atol=2e-5, rtol=2e-5
        )


def test_forced_native_runs_only_where_it_applies():
    methods = forced_methods("native")
    for (lo, _), method in zip(ROW_BUCKETS, methods, strict=True):
        assert method == ("native" if lo <= 8 or lo >= 33 else "torch")  # GEMV or GEMM


def test_choice_keeps_at_most_one_weight_copy():
    # MKL wins the big buckets, oneDNN the middle one by a hair: one copy (MKL) is kept.
    table = [
        {"torch": 3.0, "native": 1.0, "mkl_packed": 2.0, "onednn": 2.0},
        {"torch": 3.0, "mkl_packed": 1.0, "onednn": 2.0},
        {"torch": 3.0, "mkl_packed": 1.01, "onednn": 1.0},
        {"torch": 3.0, "mkl_packed": 1.0, "onednn": 2.0},
    ]
    assert choose_methods(table) == ("native", "mkl_packed", "mkl_packed", "mkl_packed")
    # A copy that saves almost nothing is not worth its memory.
    table = [{"torch": 1.0, "mkl_packed": 0.99}, {"torch": 1.0, "mkl_packed": 1.0}]
    assert choose_methods(table) == ("torch", "torch")


def test_cache_round_trip(monkeypatch):
    weights = [torch.randn(48, 32), torch.randn(32, 48), torch.randn(48, 32)]
    chosen = select_methods(weights)
    assert set(chosen) == {(48, 32), (32, 48)}
    assert all(len(m) == len(ROW_BUCKETS) and set(m) <= set(AVAILABLE) for m in chosen.values())
    path = cache_file(cache_key())
    data = json.loads(path.read_text())
    assert data["key"] == cache_key()
    assert {k: tuple(v) for k, v in data["decisions"].items()} == {
        "48x32": chosen[(48, 32)],
        "32x48": chosen[(32, 48)],
    }

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached shape was timed again")

    monkeypatch.setattr(linear_select, "time_methods", no_timing)
    assert select_methods(weights) == chosen  # read back, nothing timed


def test_new_shape_is_added_to_the_cache():
    select_methods([torch.randn(16, 32)])
    select_methods([torch.randn(24, 32)])
    decisions = json.loads(cache_file(cache_key()).read_text())["decisions"]
    assert set(decisions) == {"16x32", "24x32"}


@pytest.mark.parametrize("content", ["{not json", '{"key": 1}', "[]"])
def test_corrupt_cache_is_ignored_and_rewritten(content, caplog):
    path = cache_file(cache_key())
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        chosen = select_methods([torch.randn(16, 32)])
    assert "Ignoring the linear-method cache" in caplog.text
    assert json.loads(path.read_text())["decisions"] == {"16x32": list(chosen[(16, 32)])}


def test_forced_method_and_bad_value(monkeypatch):
    monkeypatch.setenv(LINEAR_METHOD_ENV, "torch")
    assert select_methods([torch.randn(16, 32)]) == {(16, 32): ("torch",) * len(ROW_BUCKETS)}
    assert not cache_file(cache_key()).exists()  # forcing measures and writes nothing
    monkeypatch.setenv(LINEAR_METHOD_ENV, "fastest")
    with pytest.raises(ValueError, match=LINEAR_METHOD_ENV):
        select_methods([torch.randn(16, 32)])


@pytest.mark.parametrize("method", ["auto", *AVAILABLE])
@pytest.mark.parametrize("tied", [True, False])
def test_model_layers_get_plans(tmp_path, monkeypatch, method, tied):
    monkeypatch.setenv(LINEAR_METHOD_ENV, method)
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=tied)
    model = load_model(
        path, load_hf_config(path), torch.float32, torch.device("cpu"), TorchAttentionBackend()
    )
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.plan is not None for m in linears)
    for layer in linears:
        copies = set(layer.plan.prepared) & {"mkl_packed", "onednn"}
        assert len(copies) <= 1
        for rows in (1, 6, 40, 200):
            x = torch.randn(rows, layer.in_features)
            expected = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), expected, atol=2e-5, rtol=2e-5)
    # The LM head (a table, not a Linear) has its own plan, right at every row bucket.
    assert model._logits_plan is not None
    weight = model.model.embed_tokens.weight if tied else model.lm_head.weight
    for rows in (1, 3, 6, 40, 200):
        hidden = torch.randn(rows, model.config.hidden_size)
        torch.testing.assert_close(
            model.compute_logits(hidden), F.linear(hidden, weight), atol=2e-5, rtol=2e-5
        )


def test_int8_model_plans_its_fp32_lm_head(tmp_path):
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    model = load_model(
        path,
        load_hf_config(path),
        torch.float32,
        torch.device("cpu"),
        TorchAttentionBackend(),
        quantization="int8",
    )
    assert model._logits_plan is not None
    hidden = torch.randn(40, model.config.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(hidden), F.linear(hidden, model.lm_head.weight), atol=2e-5, rtol=2e-5
    )


@pytest.mark.skipif("mkl_packed" not in AVAILABLE, reason="torch built without MKL")
def test_disagreeing_method_is_dropped(monkeypatch, caplog):
    monkeypatch.setattr(
        torch.ops.mkl, "_mkl_linear", lambda x, packed, w, b, rows: F.linear(x, w, b) + 1.0
    )
    with caplog.at_level(logging.WARNING):
        chosen = select_methods([torch.randn(40, 24)])
    assert "mkl_packed" not in chosen[(40, 24)]
    assert "disagrees" in caplog.text


def test_isa_limits_key_their_own_cache(monkeypatch):
    """Measurements taken with the libraries capped at AVX2 are not reused uncapped."""
    plain = cache_key()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    capped = cache_key()
    assert capped["isa_limits"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cache_file(capped) != cache_file(plain)


def test_bf16_weights_get_a_bf16_trial_of_their_own(tmp_path, monkeypatch):
    """A bf16 engine's layers (dtype auto on AMX / AVX512-BF16 CPUs) are timed among the
    methods that take bf16, keyed apart from fp32 shapes, and compute bf16 like F.linear."""
    from engine.layers.linear_select import BF16_METHODS

    path = make_tiny_llama(tmp_path / "m", num_layers=1, tie_word_embeddings=False)
    model = load_model(
        path, load_hf_config(path), torch.bfloat16, torch.device("cpu"), TorchAttentionBackend()
    )
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.plan is not None for m in linears)
    assert all(set(m.plan.methods) <= set(BF16_METHODS) for m in linears)
    cached = json.loads(cache_file(cache_key()).read_text())["decisions"]
    assert cached and all(name.endswith(":bfloat16") for name in cached)
    for layer in linears:
        for rows in (1, 40):
            x = torch.randn(rows, layer.in_features, dtype=torch.bfloat16)
            expected = F.linear(x, layer.weight, layer.bias).float()
            got = layer(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    hidden = torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32  # fp32 logits whatever the engine dtype
    monkeypatch.setenv(LINEAR_METHOD_ENV, "mkl_packed")  # fp32 only: bf16 falls back
    assert set(select_methods([linears[0].weight])[tuple(linears[0].weight.shape)]) == {"torch"}
