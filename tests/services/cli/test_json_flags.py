"""The engine flags whose `EngineArgs` fields are dicts or lists: each takes what vLLM's
flag takes (a JSON object; a list of ints), reaches the engine child of `serve` unchanged,
and a bad value is refused naming the flag. Fields are found from `EngineArgs`, so a new
dict field without a JSON flag fails here."""

from __future__ import annotations

import pytest

from services.cli.flags import (
    build_parser,
    engine_arg_fields,
    engine_args_from,
    flags_from,
    subparser,
)

DICT_FIELDS = [f.name for f in engine_arg_fields() if str(f.type).startswith("dict")]
LIST_FIELDS = [f.name for f in engine_arg_fields() if str(f.type).startswith("list[int]")]
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_the_json_typed_fields_are_found() -> None:
    assert "speculative_config" in DICT_FIELDS
    assert "cuda_graph_sizes" in LIST_FIELDS


@pytest.mark.parametrize("name", DICT_FIELDS)
@pytest.mark.parametrize("command", ["engine", "serve"])
def test_dict_flag_takes_a_json_object(name: str, command: str) -> None:
    ns = build_parser().parse_args([command, _flag(name), '{"a": [1, 2], "b": "c"}'])
    assert getattr(ns, name) == {"a": [1, 2], "b": "c"}
    assert getattr(build_parser().parse_args([command]), name) is None


@pytest.mark.parametrize("name", DICT_FIELDS)
@pytest.mark.parametrize(
    "bad, message",
    [("{method: ngram}", "not valid JSON"), ("[1, 2]", "expected a JSON object"), ("4", "JSON")],
)
def test_dict_flag_refuses_bad_json_naming_the_flag(name, bad, message, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", _flag(name), bad])
    err = capsys.readouterr().err
    assert f"argument {_flag(name)}:" in err and message in err


@pytest.mark.parametrize("name", LIST_FIELDS)
def test_list_flag_refuses_a_non_integer_naming_the_flag(name, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", _flag(name), "1", "two"])
    assert f"argument {_flag(name)}:" in capsys.readouterr().err


def test_speculative_config_reaches_the_engine_child_and_the_engine(tiny_model_dir) -> None:
    """As the README shows it: `serve` hands it to its engine child as JSON again, and the
    engine builds its speculative config from it."""
    parser = build_parser()
    ns = parser.parse_args(["serve", "--speculative-config", SPECULATIVE])
    engine = subparser(parser, "engine")
    args = engine_args_from(engine.parse_args(flags_from(ns, engine)))
    assert args.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
    }
    args.model = str(tiny_model_dir)
    config = args.create_engine_config()
    assert config.speculative_config is not None
    assert config.speculative_config.num_speculative_tokens == 4
