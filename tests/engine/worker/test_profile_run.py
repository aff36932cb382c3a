"""The GPU profile run's dummy step stays inside the model: its token ids inside the
vocabulary, its positions inside max_model_len. (On a GPU an id past the vocabulary is a
device-side assert that poisons the CUDA context; a tiny model with a vocabulary smaller
than the step hit it on an H200. The inputs are the same on the CPU, so this checks them
here, and runs the step.)"""

from __future__ import annotations

from pathlib import Path

import torch

from engine import EngineArgs, LLMEngine
from tests.model_utils import make_tiny_llama


def test_profile_step_ids_stay_in_a_small_vocabulary(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", hidden_size=32, num_layers=1, vocab_size=100)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), max_num_batched_tokens=300, max_model_len=256)
    )
    runner = engine.runner
    assert runner.vocab_size == 100
    tokens, computed, blocks = runner._profile_request()
    assert len(tokens) == 256  # the largest step: min(batched tokens, max_model_len)
    assert computed == 0 and len(blocks) * runner.block_size >= len(tokens)
    assert max(tokens) == 99 and min(tokens) == 0  # every id inside the vocabulary
    assert runner._dummy_tokens(5) == [0, 1, 2, 3, 4]
    caches = runner._allocate_kv_caches(len(blocks))
    runner._dummy_forward([(tokens, computed, blocks)], caches)  # ids 100.. raised here before
    assert any(bool(c.any()) for c in caches)  # the step wrote its keys and values
    assert torch.isfinite(caches[0]).all()
