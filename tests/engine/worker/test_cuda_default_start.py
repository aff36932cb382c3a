"""On a GPU: the engine a user starts (no KV-cache byte budget, graphs on) starts and serves.

Without `kv_cache_memory_bytes` / `num_gpu_blocks_override` the runner sizes its cache from
the GPU's free memory after a profile step on scratch caches, then captures the decode
graphs over the real ones; this path once crashed on first contact ('ModelRunner' object has
no attribute 'kv_caches'). The same path runs on the CPU with a stand-in runtime
(test_gpu_start_on_host.py); here it runs on the device itself."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.model_utils import make_tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_default_start_profiles_the_budget_and_captures_graphs(tmp_path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", hidden_size=64, num_layers=2)
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", max_model_len=256,
              max_num_seqs=8, cuda_graph_sizes=[1, 2, 4])  # fmt: skip
    runner = llm.llm_engine.runner
    # most of the device's memory went to the cache (the model is tiny), capped by what the
    # scheduler can use: max_num_seqs full-length sequences
    assert runner.num_blocks == 8 * 256 // runner.block_size
    assert runner.cuda_graphs is not None and runner.cuda_graphs.captured_sizes == [1, 2, 4]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12, 12]
    assert runner.cuda_graphs.num_replays > 0
