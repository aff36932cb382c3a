"""The light tokenizer (tokenizers + jinja2, services/tokenizer_service/light_tokenizer.py)
gives transformers' token ids, text, token strings and chat prompts for the tokenizer of
every family in tests/tokenizer_families.py and the default model's; what it cannot read
goes to transformers; and the service's loading never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.tokenizer_service.light_tokenizer import (
    LightTokenizer,
    LightUnsupported,
    light_unsupported,
    load_light_tokenizer,
)
from services.tokenizer_service.model_files import (
    BACKEND_ENV,
    load_model_tokenizer,
    read_generation_config,
)
from tests.services.processes import ROOT, child_env
from tests.tokenizer_families import CORPUS, FAMILIES, make_family_tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "  two  spaces\n\nnew lines\ttab",
    "Grüße, 日本語 and 한국어 🙂👍🏽 ∑≤",
    "unseen letters: ʃ ɮ ꙮ 𓀀",
    "<s> [INST] looks special <|im_end|><|eot_id|><bos> [CLS]",
    "don't , stop . it 's here ?",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
        {"role": "user", "content": "  and 日本 🙂  "},
    ],
    [
        {"role": "user", "content": "Continue this"},
        {"role": "assistant", "content": "Once upon a time "},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"x": "<int>"}}}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory) -> tuple[str, LightTokenizer, object]:
    from transformers import AutoTokenizer

    family = request.param
    directory = make_family_tokenizer(family, tmp_path_factory.mktemp(family))
    return family, load_light_tokenizer(directory), AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory) -> tuple[LightTokenizer, object]:
    """The default model's tokenizer files (its converted GGUF entry)."""
    from transformers import AutoTokenizer

    from tests.model_utils import _copy_tokenizer

    directory = tmp_path_factory.mktemp("smollm2")
    _copy_tokenizer(None, directory)
    return load_light_tokenizer(directory), AutoTokenizer.from_pretrained(directory)


def _same_everything(light: LightTokenizer, hf: object) -> None:
    assert light.special_tokens_map == hf.special_tokens_map
    assert len(light) == len(hf)
    for text in TEXTS:
        for add_special in (True, False):
            ids = light(text, add_special_tokens=add_special).input_ids
            assert ids == hf(text, add_special_tokens=add_special).input_ids, (text, add_special)
        assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        full = light(text).input_ids
        for skip in (True, False):
            assert light.decode(full, skip_special_tokens=skip) == hf.decode(
                full, skip_special_tokens=skip
            ), (text, skip)
            assert light.decode(
                full, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            ) == hf.decode(full, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_ids_text_and_tokens_match_transformers(pair):
    _family, light, hf = pair
    _same_everything(light, hf)


def test_the_default_models_tokenizer_matches_transformers(default_pair):
    light, hf = default_pair
    _same_everything(light, hf)
    for chat in CHATS[:2]:
        for add in (True, False):
            ours = light.apply_chat_template(chat, add_generation_prompt=add)
            assert ours == hf.apply_chat_template(chat, add_generation_prompt=add, tokenize=False)


def _render(tokenizer: object, chat: list, **kwargs: object) -> str | type:
    """The prompt, or the type of error the template raised."""
    try:
        return tokenizer.apply_chat_template(chat, tokenize=False, **kwargs)
    except (jinja2.TemplateError, ValueError) as exc:
        return type(exc)


def test_chat_prompts_match_transformers(pair):
    family, light, hf = pair
    if hf.chat_template is None:
        assert light.chat_template is None
        with pytest.raises(ValueError, match="no chat template"):
            light.apply_chat_template(CHATS[0])
        return
    rendered = 0
    for chat in CHATS:
        for kwargs in (
            {"add_generation_prompt": True},
            {"add_generation_prompt": False},
            {"continue_final_message": True},
            {"add_generation_prompt": True, "tools": TOOLS},
        ):
            ours = _render(light, chat, **kwargs)
            assert ours == _render(hf, chat, **kwargs), (family, chat, kwargs)
            rendered += isinstance(ours, str)
            if isinstance(ours, str):  # the service encodes prompts without special tokens
                ids = light(ours, add_special_tokens=False).input_ids
                assert ids == hf(ours, add_special_tokens=False).input_ids
    assert rendered >= 4  # the comparison is of prompts, not only of errors


def test_a_templates_own_errors_raise_as_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    directory = make_family_tokenizer("mistral", tmp_path)
    light = load_light_tokenizer(directory)
    hf = AutoTokenizer.from_pretrained(directory)
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="must alternate") as ours:
        light.apply_chat_template(twice)
    with pytest.raises(jinja2.TemplateError) as theirs:
        hf.apply_chat_template(twice, tokenize=False)
    assert str(ours.value) == str(theirs.value)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(alphabet=st.sampled_from("".join(CORPUS) + "<|>[]/ \n\x00é🙂ꙮ"), max_size=60))
def test_random_text_encodes_as_in_transformers(pair, text):
    _family, light, hf = pair
    for add_special in (True, False):
        assert (
            light(text, add_special_tokens=add_special).input_ids
            == hf(text, add_special_tokens=add_special).input_ids
        )


def test_what_needs_transformers_is_left_to_it(tmp_path, caplog):
    """A model-specific tokenizer class, a missing tokenizer.json and the escape hatch all
    load transformers' tokenizer, saying why once."""
    llama = make_family_tokenizer("mistral", tmp_path / "llama", tokenizer_class="LlamaTokenizer")
    assert "LlamaTokenizer" in light_unsupported(llama)
    no_json = make_family_tokenizer("llama3", tmp_path / "nojson")
    (no_json / "tokenizer.json").rename(no_json / "other.json")
    assert "no tokenizer.json" in light_unsupported(no_json)
    generic = make_family_tokenizer("llama3", tmp_path / "generic")
    assert light_unsupported(generic) is None
    with caplog.at_level("INFO", logger="services.tokenizer_service.model_files"):
        assert not isinstance(load_model_tokenizer(llama), LightTokenizer)
        assert isinstance(load_model_tokenizer(generic), LightTokenizer)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("transformers" in line and "LlamaTokenizer" in line for line in lines) == 1
    assert any("tokenizers + jinja2" in line for line in lines)


def _edit_config(directory: Path, **fields: object) -> Path:
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return directory


def test_config_that_transformers_acts_on_is_left_to_it(tmp_path):
    """An added token tokenizer.json lacks (transformers adds it, at an id of its choosing)
    and `fix_mistral_regex` go to transformers; added tokens that agree stay light."""
    agree = _edit_config(
        make_family_tokenizer("qwen2", tmp_path / "agree"),
        added_tokens_decoder={"2": {"content": "<|im_end|>", "special": True}},
    )
    assert isinstance(load_model_tokenizer(agree), LightTokenizer)
    lacking = _edit_config(
        make_family_tokenizer("qwen2", tmp_path / "lacking"),
        added_tokens_decoder={"999": {"content": "<|new|>", "special": True}},
    )
    with pytest.raises(LightUnsupported, match="added_tokens_decoder"):
        load_light_tokenizer(lacking)
    hf = load_model_tokenizer(lacking)
    assert not isinstance(hf, LightTokenizer)
    regex = _edit_config(make_family_tokenizer("qwen2", tmp_path / "regex"), fix_mistral_regex=True)
    assert "fix_mistral_regex" in light_unsupported(regex)


def test_the_escape_hatch_loads_transformers(tmp_path, monkeypatch):
    generic = make_family_tokenizer("llama3", tmp_path)
    monkeypatch.setenv(BACKEND_ENV, "transformers")
    tokenizer = load_model_tokenizer(generic)
    assert not isinstance(tokenizer, LightTokenizer)
    assert tokenizer("Hello").input_ids == load_light_tokenizer(generic)("Hello").input_ids


@pytest.mark.parametrize(
    "config",
    [
        {"do_sample": False, "temperature": 0.7, "top_k": 20, "max_new_tokens": 64},
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1},
        {"bos_token_id": 1, "eos_token_id": [2, 3], "min_p": None, "temperature": 1.0},
    ],
)
def test_generation_config_defaults_match_transformers(tmp_path, config):
    from transformers import GenerationConfig

    from engine.api.sampling_params import generation_config_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    theirs = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    ours = read_generation_config(tmp_path)
    assert generation_config_defaults(ours) == generation_config_defaults(theirs)


LOAD_WITHOUT_TRANSFORMERS = """
import sys
from services.cli.main import main  # the command's module, as the process imports it
from services.tokenizer_service.model_files import load_text_model_files
from services.tokenizer_service.preprocess import Preprocessor
from services.tokenizer_service.text_stream import TokenTexts
from engine.api.stream_detokenizer import StreamDetokenizer, make_detokenizer
files = load_text_model_files(sys.argv[1])
tok = files.tokenizer
ids = tok("Hello there 🙂").input_ids
prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
detok = make_detokenizer(tok, ids, stop=["\\n"])
assert isinstance(detok, StreamDetokenizer), type(detok)
detok.update(tok(" and more", add_special_tokens=False).input_ids)
assert detok.get_text(True).strip() == "and more", detok.get_text(True)
TokenTexts(tok)(ids[0])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torch"))
assert not loaded, loaded[:5]
print("ok", type(tok).__name__, len(prompt) > 0)
"""


def test_the_service_loads_its_tokenizer_without_transformers(tmp_path):
    """The tokenizer process's loading path (the command's module, the model files, a chat
    prompt, a stream's detokenizer) in a fresh interpreter: transformers never imported."""
    directory = make_family_tokenizer("qwen2", tmp_path)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_TRANSFORMERS, str(directory)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "LightTokenizer", "True"]


def test_special_tokens_missing_from_the_vocabulary_are_added_once():
    """A named or extra special token that tokenizer.json lacks is added as a special token;
    one it has, in the model's vocabulary or among its added tokens, is not added again."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>"])  # id 3, an added token
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False},
        "unk_token": "<unk>",
        "additional_special_tokens": ["a", "<extra>"],
    }
    tokenizer = LightTokenizer(backend, config, None)
    assert len(tokenizer) == 6  # 3 + <s> + the two missing: </s> and <extra>
    assert tokenizer.bos_token_id == 3
    assert tokenizer.eos_token_id == backend.token_to_id("</s>") == 4
    assert backend.token_to_id("<extra>") == 5
    assert backend.encode("a </s> <extra>", add_special_tokens=False).ids == [0, 4, 5]
