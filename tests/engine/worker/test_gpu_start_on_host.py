"""The GPU start-up as a user runs it (no byte budget, graphs on), run on the CPU.

With neither `kv_cache_memory_bytes` nor `num_gpu_blocks_override`, a GPU engine sizes its
KV cache from the device memory left after a profile step (the largest step, on scratch
caches), then allocates the cache, warms up and captures the decode graphs. Only a GPU takes
that path, and it once crashed there on first contact ('ModelRunner' object has no attribute
'kv_caches': the profile step's forward looked for the real caches before they existed).

Here the runner gets a CPU stand-in for the CUDA runtime (host_runtime.py) and graphs are
asked for, so the same code runs with its real forwards (the Triton backend, in the
interpreter, is the one that supports graphs): the budget's order and arithmetic, the graphs
captured over the real caches and replayed for decode steps with the eager tokens, and
sleep level 1's round trip of the weights through host memory with the graphs captured again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import engine.config.engine_config as engine_config_module
import engine.worker.model_runner as model_runner_module
from engine import LLM, SamplingParams
from engine.config.cuda_graph import CudaGraphConfig
from tests.engine.worker.host_runtime import HostRuntime
from tests.model_utils import make_tiny_llama

MiB = 2**20
GRAPH_SIZES = (1, 2, 4)
# Every Triton launch runs in the interpreter here (~0.5 s each), so the shapes are the
# smallest that still take every path: a 64-token profile step, three prompts in one prefill
# step, then decode batches of 3, 2 and 1 rows (each graph size, 4 2 1, replayed).
COMMON = dict(
    device="cpu", dtype="float32", attention_backend="triton", max_model_len=64,
    max_num_seqs=4, max_num_batched_tokens=64,
)  # fmt: skip
PROMPTS = [{"prompt_token_ids": [3 + (i * 7 + j) % 100 for j in range(n)]} for i, n in
           enumerate([5, 19, 11])]  # fmt: skip
PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (2, 4, 6)]

# The Triton backend runs on CPU tensors only in the interpreter, which tests/conftest.py
# turns on where there is no GPU; on a GPU the real start runs instead
# (test_cuda_default_start.py, test_cuda_graph_tokens.py).
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="a GPU machine runs the real GPU start (test_cuda_default_start.py)",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=2)


def _gpu_like_llm(monkeypatch, model_dir: Path, runtime: HostRuntime) -> LLM:
    """The engine of a default GPU start: the runtime stands in for torch.cuda and the
    graph sizes are not dropped for the CPU device."""
    monkeypatch.setattr(model_runner_module, "device_runtime", lambda device: runtime)
    monkeypatch.setattr(
        engine_config_module,
        "resolve_cuda_graph_config",
        lambda *args: CudaGraphConfig(GRAPH_SIZES),
    )
    return LLM(model=str(model_dir), **COMMON)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_default_gpu_start_sizes_the_cache_after_a_profile_step(monkeypatch, model_dir) -> None:
    # per block: 16 tokens x (keys + values) x 2 KV heads x head_dim 8 x 4 bytes x 2 layers
    per_block = 16 * 2 * 2 * 8 * 4 * 2
    total, peak, reserved, other = 64 * MiB, 3 * MiB, 4 * MiB, 2 * MiB
    want_blocks = 12  # under the cap of what the scheduler can use (4 seqs x 4 blocks)
    # budget = total x 0.9 - peak - other; choose `peak` so the budget is 12.5 blocks
    peak = int(total * 0.9) - other - int(want_blocks * per_block + per_block // 2)
    holder: dict[str, LLM] = {}
    runtime = HostRuntime(total, peak, reserved, other,
                          probe=lambda: len(holder["runner"].kv_caches))  # fmt: skip
    real_init = model_runner_module.ModelRunner.initialize_kv_cache

    def initialize(runner, num_blocks: int) -> None:
        holder["runner"] = runner
        runtime.events.append(f"initialize_kv_cache {num_blocks}")
        real_init(runner, num_blocks)

    monkeypatch.setattr(model_runner_module.ModelRunner, "initialize_kv_cache", initialize)
    llm = _gpu_like_llm(monkeypatch, model_dir, runtime)
    runner = llm.llm_engine.runner
    assert runner.kv_bytes_per_block == per_block
    assert runner.num_blocks == want_blocks  # (0.9 x total - peak - other) // per block
    budget_steps = [
        "empty_cache", "reset_peak_memory_stats", "synchronize",  # the profile step
        "mem_get_info", "max_memory_allocated", "memory_reserved",
        f"initialize_kv_cache {want_blocks}", "mem_get_info", "graph_pool",
    ]  # fmt: skip
    assert runtime.events[: len(budget_steps)] == budget_steps
    captures = [e for e in runtime.events if e.startswith("capture")]
    assert captures == ["capture 4", "capture 2", "capture 1"]  # largest first
    assert runtime.probed == [2, 2, 2]  # every graph over the two layers' real caches
    assert runner.cuda_graphs is not None and runner.cuda_graphs.captured_sizes == [1, 2, 4]
    # the real caches: the blocks plus the graphs' padding block
    assert runner.kv_caches[0].shape[1] == want_blocks + 1

    got = _tokens(llm)
    assert runner.cuda_graphs.num_replays > 0  # decode steps went through the graphs
    monkeypatch.undo()
    want = _tokens(LLM(model=str(model_dir), **COMMON))  # the CPU engine: eager
    assert got == want
    assert [len(t) for t in got] == [2, 4, 6]


def test_sleep_level_1_on_a_gpu_parks_the_weights_in_host_memory(monkeypatch, model_dir) -> None:
    runtime = HostRuntime(total=64 * MiB, peak=8 * MiB, reserved=8 * MiB)
    llm = _gpu_like_llm(monkeypatch, model_dir, runtime)
    runner = llm.llm_engine.runner
    before = _tokens(llm)
    num_tensors = len([*runner.model.parameters(), *runner.model.buffers()])
    runtime.events.clear()
    llm.sleep(level=1)
    assert runtime.events.count("to_host") == num_tensors
    assert runtime.events[-2:] == ["synchronize", "empty_cache"]  # memory given back
    assert all(p.numel() == 0 for p in runner.model.parameters())  # only placeholders left
    assert runner.kv_caches == [] and runner.cuda_graphs.captured_sizes == []
    llm.wake_up()
    assert runner.cuda_graphs.captured_sizes == [1, 2, 4]  # captured again, new addresses
    replays = runner.cuda_graphs.num_replays
    assert _tokens(llm) == before
    assert runner.cuda_graphs.num_replays > replays
