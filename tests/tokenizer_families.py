"""Tiny tokenizers in the style of each model family, built locally (nothing is downloaded):
a BPE trained in milliseconds on a small multilingual corpus, wrapped in the family's
pipeline (byte-level like Llama 3, Qwen2, DeepSeek and GPT-OSS; sentencepiece-style with
byte fallback like Llama 2, Mistral and Phi-3; Gemma's space replacement; BERT's WordPiece)
and saved with a chat template written in that family's manner, exercising what templates use
(`raise_exception`, `namespace`, `tojson`, loop controls, `strftime_now`, tools, reasoning
fields, `{% generation %}`, the special-token variables).

The files are saved as transformers reads them, with `tokenizer_class`
PreTrainedTokenizerFast (transformers v5's generic class): the real Qwen2, Gemma and Mistral
files name their own classes, which transformers rebuilds and the tokenizer service therefore
leaves to transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer, WordPieceTrainer

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. It's 2026; don't panic!",
    "Grüße aus München: Straße, Käse, Öl und Übermut.",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "Emoji 🙂🚀👍🏽 and symbols ∑ ≤ ≥ → ← « » — “quotes”.",
    "def add(a, b):\n    return a + b\n\n# code with    spaces\tand tabs",
    "Numbers 1234567890 and 3.14159, 2,718; 1e-9.",
] * 4

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}{{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n"
    "{%- elif messages[0].role != 'system' %}"
    "<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{% if message.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' and tools %}{% continue %}{% endif %}\n"
    "<|im_start|>{{ message.role }}\n"
    "{%- if message.reasoning_content and loop.index0 > ns.last_user %}"
    "<think>\n{{ message.reasoning_content }}\n</think>\n{% endif %}"
    "{{ message.content }}<|im_end|>\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{% generation %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endgeneration %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
DEEPSEEK_TEMPLATE = (
    "{% set ns = namespace(system_prompt='', first=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
GPT_OSS_TEMPLATE = (
    "<|start|>system<|message|>Knowledge cutoff: 2024-06\n"
    "Current date: {{ strftime_now('%Y') }}\n\nReasoning: medium<|end|>"
    "{%- set meta = dict(channel='final') %}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ message.thinking }}<|end|>{% endif -%}"
    "<|start|>assistant<|channel|>{{ meta.channel }}<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'user' -%}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{%- else -%}<|start|>developer<|message|>{{ message.content }}<|end|>"
    "{%- endif -%}{%- if loop.index > 8 %}{% break %}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def _train_bpe(
    special: list[str], pre_tokenizer: Any = None, normalizer: Any = None, vocab_size: int = 400
) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=(
            pre_tokenizers.ByteLevel.alphabet()
            if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel)
            else []
        ),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _byte_level(special: list[str], bos: str | None) -> Tokenizer:
    tok = _train_bpe(special, pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.decoder = decoders.ByteLevel()
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def _byte_fallback(special: list[str], bos: str, gemma: bool = False) -> Tokenizer:
    """A sentencepiece-style BPE: `▁` for spaces, bytes <0x00>..<0xFF> for what it lacks."""
    if gemma:
        normalizer = normalizers.Replace(" ", "▁")
        pre = None
    else:
        normalizer = None
        pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained = _train_bpe(special, pre, normalizer, vocab_size=300)
    data = json.loads(trained.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    model = models.BPE(
        vocab=vocab,
        merges=[
            tuple(m) if isinstance(m, list) else tuple(m.split(" "))
            for m in data["model"]["merges"]
        ],
        byte_fallback=True,
        unk_token="<unk>",
        fuse_unk=True,
    )
    tok = Tokenizer(model)
    tok.add_special_tokens(special)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre is not None:
        tok.pre_tokenizer = pre
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if not gemma:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


def _wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = WordPieceTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.decoder = decoders.WordPiece()
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tok


# family: (tokenizer builder, tokenizer_config.json fields, chat template, template in a file)
FAMILIES: dict[str, tuple[Any, dict[str, Any], str | None, bool]] = {
    "llama3": (
        lambda: _byte_level(
            ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
            "<|begin_of_text|>",
        ),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        LLAMA3_TEMPLATE,
        False,
    ),
    "qwen2": (
        lambda: _byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None),
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        QWEN_TEMPLATE,
        True,
    ),
    "mistral": (
        lambda: _byte_fallback(["<unk>", "<s>", "</s>"], "<s>"),
        {
            "bos_token": {"__type": "AddedToken", "content": "<s>", "normalized": False},
            "eos_token": {"__type": "AddedToken", "content": "</s>", "normalized": False},
            "unk_token": "<unk>",
            "add_bos_token": True,  # dropped by transformers where tokenizer.json exists
            "add_eos_token": True,
        },
        MISTRAL_TEMPLATE,
        False,
    ),
    "gemma": (
        lambda: _byte_fallback(["<pad>", "<eos>", "<bos>", "<unk>"], "<bos>", gemma=True),
        {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "extra_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        },
        GEMMA_TEMPLATE,
        True,
    ),
    "phi3": (
        lambda: _byte_fallback(["<unk>", "<s>", "</s>", "<|end|>", "<|user|>"], "<s>"),
        {"bos_token": "<s>", "eos_token": "<|end|>", "unk_token": "<unk>"},
        PHI3_TEMPLATE,
        False,
    ),
    "deepseek": (
        lambda: _byte_level(
            ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
            "<｜begin▁of▁sentence｜>",
        ),
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
        DEEPSEEK_TEMPLATE,
        False,
    ),
    "gpt_oss": (
        lambda: _byte_level(
            ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"], None
        ),
        {"eos_token": "<|return|>", "pad_token": "<|end|>"},
        GPT_OSS_TEMPLATE,
        True,
    ),
    "bert": (
        _wordpiece,
        {
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "mask_token": "[MASK]",
            "clean_up_tokenization_spaces": True,
        },
        None,
        False,
    ),
}


def make_family_tokenizer(family: str, directory: Path, tokenizer_class: str = "") -> Path:
    """`directory` with the family's tokenizer.json, tokenizer_config.json (and
    chat_template.jinja where the family keeps its template in a file)."""
    build, fields, template, template_file = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    build().save(str(directory / "tokenizer.json"))
    config = {k: v for k, v in fields.items() if v is not None}
    config["tokenizer_class"] = tokenizer_class or "PreTrainedTokenizerFast"
    config["model_max_length"] = 4096
    if template is not None and template_file:
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory
