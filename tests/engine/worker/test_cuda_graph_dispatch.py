"""The choice between a captured graph and an eager forward, per step and per engine.

Per step (`choose_graph_size`): only pure decode steps replay a graph, padded to the next
captured size; prefill, mixed and speculative steps, LoRA steps and batches above the
largest size run eagerly. Per engine (`graphs_unsupported_reason`): only an attention
backend whose launches read device tensors can be replayed, on one rank, without LoRA or
MoE routing (both decide on the host). On CPU the engine never captures and keeps no
padding block."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import EngineArgs, LLMEngine
from engine.api.model_files import load_hf_config
from engine.attention.backend import get_attention_backend
from engine.config.cuda_graph import CudaGraphConfig
from engine.loader.model_loader import load_model
from engine.worker.cuda_graphs import choose_graph_size, graphs_unsupported_reason
from engine.worker.inputs import build_step_inputs
from tests.model_utils import make_tiny_llama, make_tiny_model

CPU = torch.device("cpu")
CONFIG = CudaGraphConfig((1, 2, 4, 8))


def _metadata(*requests: tuple[list[int], int, list[int]]):
    return build_step_inputs(list(requests), 16, CPU).attn_metadata


def test_pure_decode_steps_pad_to_the_next_captured_size() -> None:
    decodes = [([7], 5 + i, [i]) for i in range(8)]
    sizes = [choose_graph_size(CONFIG, _metadata(*decodes[:n])) for n in range(1, 9)]
    assert sizes == [1, 2, 4, 4, 8, 8, 8, 8]
    too_many = [([7], 5, [i]) for i in range(9)]
    assert choose_graph_size(CONFIG, _metadata(*too_many)) is None  # above 8: eager


def test_prefill_mixed_speculative_and_lora_steps_run_eagerly() -> None:
    decode, prefill = ([7], 10, [0]), ([1, 2, 3], 0, [1])
    assert choose_graph_size(CONFIG, _metadata(decode, prefill)) is None  # mixed
    assert choose_graph_size(CONFIG, _metadata(prefill)) is None  # prefill
    verify = ([7, 8, 9], 20, [0, 2])  # a decode with two draft tokens to verify
    assert choose_graph_size(CONFIG, _metadata(decode, verify)) is None
    assert choose_graph_size(CONFIG, _metadata(decode), eager_only=True) is None  # LoRA
    assert choose_graph_size(CudaGraphConfig(), _metadata(decode)) is None  # graphs off
    # block tables wider than the graph buffers (blocks held ahead for drafts): eager
    wide = ([7], 10, [0, 1, 2])
    assert choose_graph_size(CONFIG, _metadata(wide), max_blocks_per_req=3) == 1
    assert choose_graph_size(CONFIG, _metadata(wide), max_blocks_per_req=2) is None
    # A one-token prompt has a decode's shape (one query token over its context): the
    # graph computes it as eagerly.
    assert choose_graph_size(CONFIG, _metadata(([5], 0, [3]), decode)) == 2


def _model(model_dir: Path, backend_name: str):
    backend = get_attention_backend(backend_name, CPU, torch.float32)
    model = load_model(model_dir, load_hf_config(model_dir), torch.float32, CPU, backend)
    return backend, model


def test_engines_whose_forward_decides_on_the_host_are_not_captured(tmp_path: Path) -> None:
    llama = make_tiny_llama(tmp_path / "llama", hidden_size=32, num_layers=1)
    triton, model = _model(llama, "triton")  # the Triton interpreter stands in for CUDA
    assert graphs_unsupported_reason(triton, model, world_size=1, lora=False) is None
    assert "parallel" in graphs_unsupported_reason(triton, model, world_size=2, lora=False)
    assert "lora" in graphs_unsupported_reason(triton, model, world_size=1, lora=True)
    torch_backend, model = _model(llama, "torch")
    assert "'torch' attention backend" in graphs_unsupported_reason(
        torch_backend, model, world_size=1, lora=False
    )
    mixtral = make_tiny_model(
        tmp_path / "mixtral", "MixtralForCausalLM", hidden_size=32, num_layers=1,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    triton, model = _model(mixtral, "triton")
    assert "mixture-of-experts" in graphs_unsupported_reason(triton, model, 1, lora=False)


def test_cpu_engine_has_no_graphs_and_no_padding_block(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", hidden_size=32, num_layers=1)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), device="cpu", max_model_len=64, max_num_seqs=4)
    )
    runner = engine.runner
    assert runner.cuda_graphs is None
    assert runner.kv_caches[0].shape[1] == runner.num_blocks
