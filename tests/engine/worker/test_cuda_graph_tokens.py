"""On a GPU: decode with CUDA graphs gives the tokens of the eager engine (enforce_eager).

Five greedy requests of different lengths finish one after another, so the decode batch
shrinks 5, 4, 3, 2, 1 over captured sizes 1, 2, 4: batches of 5 run eagerly (above the
largest size), 3 pads to 4, the others replay their own size. fp32, so the comparison is
exact: a graph replays the eager forward's kernels, and padding rows do not touch the real
rows. The test also checks that graphs were captured and replayed (a silent fallback to
eager would otherwise pass)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.model_utils import make_tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def test_graphs_give_the_eager_tokens(tmp_path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", hidden_size=64, num_layers=2)
    prompts = [
        {"prompt_token_ids": [3 + (i * 11 + j) % 120 for j in range(n)]}
        for i, n in enumerate([4, 17, 33, 9, 60])
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 10, 14, 18, 24)
    ]
    common = dict(
        model=str(model_dir),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_model_len=256,
        kv_cache_memory_bytes=32 * 2**20,
        max_num_seqs=8,
    )
    graphs = LLM(cuda_graph_sizes=[1, 2, 4], **common)
    runner = graphs.llm_engine.runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.captured_sizes == [1, 2, 4]
    got = graphs.generate(prompts, params, use_tqdm=False)
    assert runner.cuda_graphs.num_replays > 0
    del graphs
    eager = LLM(enforce_eager=True, **common)
    assert eager.llm_engine.runner.cuda_graphs is None
    want = eager.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [len(o.outputs[0].token_ids) for o in got] == [6, 10, 14, 18, 24]
