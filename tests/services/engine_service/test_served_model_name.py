"""vLLM's `--served-model-name` on the engine: one name or several, the first reported over
vLLM's engine protocol (`GetModelInfo.served_model_name`, what smg lists at `/v1/models` and
routes by: tests/services/cli/test_openai_door.py asks the real gateway); unset, the model as
given. Names clients must type exactly: blank or repeated ones are refused naming the field."""

from __future__ import annotations

import pytest

from engine import EngineArgs
from services.cli.flags import build_parser, engine_args_from, flags_from, subparser
from services.engine_service.vllm_servicer import model_info


def _config(model_dir, **kwargs):
    return EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, **kwargs
    ).create_engine_config()


@pytest.mark.parametrize(
    "value, reported",
    [(None, None), ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"), (["a", "b"], "a")],
)
def test_first_name_is_reported_over_vllms_protocol(tiny_model_dir, value, reported) -> None:
    config = _config(tiny_model_dir, served_model_name=value)
    info = model_info(config)
    assert info.served_model_name == (reported or str(tiny_model_dir))
    assert info.model_path == str(tiny_model_dir)  # the files stay where they are


@pytest.mark.parametrize("bad", ["", " padded ", ["a", "a"], ["a", ""]])
def test_blank_or_repeated_names_are_refused(tiny_model_dir, bad) -> None:
    with pytest.raises(ValueError, match="served_model_name"):
        _config(tiny_model_dir, served_model_name=bad)


def test_flag_takes_several_names_and_reaches_the_engine_child() -> None:
    parser = build_parser()
    ns = parser.parse_args(["serve", "--served-model-name", "SmolLM2-135M-Instruct", "smol"])
    engine = subparser(parser, "engine")
    args = engine_args_from(engine.parse_args(flags_from(ns, engine)))
    assert args.served_model_name == ["SmolLM2-135M-Instruct", "smol"]
    assert engine_args_from(parser.parse_args(["engine"])).served_model_name is None
