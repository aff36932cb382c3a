"""A padded decode step over the graph buffers computes what the eager step computes.

A captured graph replays the model's forward over `DecodeInputBuffers` at the captured
size: the step's rows, padding rows after them, and host bounds (max_seq_len =
max_model_len) in place of the step's own. This runs that forward with the Triton backend
(the one that is captured on CUDA; here in Triton's interpreter) and checks that the real
rows' hidden states and cache writes match the eager step's, and that the padding rows write
only the padding block. The replay itself needs a GPU: test_cuda_graph_tokens.py."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.api.model_files import load_hf_config
from engine.attention.backend import get_attention_backend
from engine.loader.model_loader import load_model
from engine.worker.cuda_graphs import DecodeInputBuffers
from engine.worker.inputs import build_step_inputs
from tests.model_utils import make_tiny_llama

CPU = torch.device("cpu")
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 4, 12, 64
PAD_BLOCK = NUM_BLOCKS  # the one block past the scheduler's


@torch.inference_mode()
def test_padded_step_matches_the_eager_step(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", hidden_size=32, num_heads=4, num_kv_heads=2)
    backend = get_attention_backend("triton", CPU, torch.float32)
    model = load_model(model_dir, load_hf_config(model_dir), torch.float32, CPU, backend)
    head_dim = 32 // 4
    shape = (2, NUM_BLOCKS + 1, BLOCK_SIZE, 2, head_dim)
    caches = [torch.zeros(shape) for _ in range(model.num_local_layers)]
    prompts = [[3, 14, 15, 92, 6], [5, 35, 8, 97, 9, 32, 38, 4, 62], [6, 43]]
    tables = [[0, 1], [2, 3, 4], [5]]
    prefill = build_step_inputs([(p, 0, t) for p, t in zip(prompts, tables)], BLOCK_SIZE, CPU)
    model(prefill.input_ids, prefill.positions, caches, prefill.attn_metadata)
    step = build_step_inputs(
        [([11 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))], BLOCK_SIZE, CPU
    )
    eager_caches = [c.clone() for c in caches]
    eager = model(step.input_ids, step.positions, eager_caches, step.attn_metadata)

    buffers = DecodeInputBuffers(8, MAX_MODEL_LEN // BLOCK_SIZE, PAD_BLOCK, BLOCK_SIZE, CPU)
    assert buffers.load(step) == 3
    metadata = buffers.metadata(4, max_seq_len=MAX_MODEL_LEN)  # graph of 4: one padding row
    padded = model(buffers.input_ids[:4], buffers.positions[:4], caches, metadata)

    assert padded.shape[0] == 4
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    for got, want in zip(caches, eager_caches):
        torch.testing.assert_close(got[:, :NUM_BLOCKS], want[:, :NUM_BLOCKS], atol=1e-5, rtol=1e-5)
        assert not want[:, PAD_BLOCK].any()  # the eager step never touches it
        assert got[:, PAD_BLOCK, 0].abs().sum() > 0  # the padding row's key and value
        assert not got[:, PAD_BLOCK, 1:].any()  # and nothing else
