"""The default model's tokenizer as the tokenizer service loads it (the light tokenizer), for
the tests of its text path (test_text_stream.py, test_process_messages.py)."""

from __future__ import annotations

import pytest

from services.tokenizer_service.light_tokenizer import load_light_tokenizer
from tests.model_utils import _copy_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("smollm2")
    _copy_tokenizer(None, directory)
    return load_light_tokenizer(directory)
