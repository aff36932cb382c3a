"""`PoolerConfig`: validation, `EngineArgs.pooler_config` as a dataclass or a dict, and the
defaults read from a sentence-transformers model directory (modules.json + the Pooling
module's config.json), as vLLM reads them. No model is run except in the engine test."""

from __future__ import annotations

import json

import pytest

from engine import EngineArgs, PoolerConfig
from engine.config.pooler import matryoshka_dimensions, sentence_transformers_pooling
from tests.model_utils import make_tiny_llama


def write_sentence_transformers(path, mode: str | None, normalize: bool = True):
    """modules.json with Transformer, Pooling (mode `mode`) [and Normalize] modules."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    config = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": mode == "max",
        "pooling_mode_lasttoken": mode == "last",
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))


def test_validation_and_from_value():
    assert PoolerConfig("mean").pooling_type == "MEAN"
    assert PoolerConfig.from_value({"pooling_type": "cls", "normalize": False}) == PoolerConfig(
        "CLS", False
    )
    assert PoolerConfig.from_value(None) == PoolerConfig()
    config = PoolerConfig("LAST")
    assert PoolerConfig.from_value(config) is config
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        PoolerConfig("MAX")
    with pytest.raises(ValueError, match="normalize must be a bool"):
        PoolerConfig(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown keys \\['dimension'\\]"):
        PoolerConfig.from_value({"dimension": 3})
    with pytest.raises(TypeError, match="pooler_config must be"):
        PoolerConfig.from_value("MEAN")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "normalize", "expected"),
    [
        ("mean", True, {"pooling_type": "MEAN", "normalize": True}),
        ("cls", False, {"pooling_type": "CLS", "normalize": False}),
        ("last", True, {"pooling_type": "LAST", "normalize": True}),
        ("max", True, {}),  # a mode this engine does not have: not taken from the model
    ],
)
def test_sentence_transformers_directory(tmp_path, mode, normalize, expected):
    write_sentence_transformers(tmp_path, mode, normalize)
    assert sentence_transformers_pooling(tmp_path) == expected


def test_resolve_order(tmp_path):
    assert PoolerConfig().resolve(tmp_path) == PoolerConfig("LAST", True)  # not an ST model
    (tmp_path / "modules.json").write_text("not json")
    assert PoolerConfig().resolve(tmp_path) == PoolerConfig("LAST", True)
    write_sentence_transformers(tmp_path, "cls", normalize=False)
    assert PoolerConfig().resolve(tmp_path) == PoolerConfig("CLS", False)
    assert PoolerConfig("mean").resolve(tmp_path) == PoolerConfig("MEAN", False)
    assert PoolerConfig(normalize=True).resolve(tmp_path) == PoolerConfig("CLS", True)


def test_matryoshka_dimensions():
    class Config:
        pass

    config = Config()
    assert matryoshka_dimensions(config) == (False, None)
    config.is_matryoshka = True  # type: ignore[attr-defined]
    assert matryoshka_dimensions(config) == (True, None)
    config.matryoshka_dimensions = [768, 256]  # type: ignore[attr-defined]
    assert matryoshka_dimensions(config) == (True, [768, 256])


def test_engine_config_reads_the_model_directory(tmp_path):
    path = make_tiny_llama(tmp_path / "st", max_position_embeddings=64)
    write_sentence_transformers(path, "mean")
    assert EngineArgs(model=str(path)).create_engine_config().pooler_config == PoolerConfig(
        "MEAN", True
    )
    explicit = EngineArgs(model=str(path), pooler_config=PoolerConfig("CLS"))
    assert explicit.create_engine_config().pooler_config == PoolerConfig("CLS", True)
    with pytest.raises(ValueError, match="pooling_type"):
        EngineArgs(model=str(path), pooler_config={"pooling_type": "max"}).create_engine_config()
