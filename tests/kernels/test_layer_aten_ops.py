"""No aten elementwise kernel is left in a Llama layer on the Triton path (issue 42): per
layer, a step runs GEMMs and Triton kernels only (RMSNorm + residual, the fused rotary +
KV write, attention, SiLU-and-mul); everything else is a view.

The aten ops a layer dispatches are what a step with one layer more dispatches in addition:
the engine generates the same tokens with a 2-layer and a 3-layer model (the same prompt,
prefill and decode steps) and the two op counts are subtracted. The ops Triton's interpreter
runs to move a kernel's arguments (on a GPU there are none) are not counted.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.loader.model_loader as model_loader
from engine import LLM, SamplingParams
from tests.model_utils import make_tiny_llama

# Ops that launch no device kernel (views, allocations), and the GEMMs of the projections.
NO_KERNEL = {
    "view", "_unsafe_view", "slice", "select", "as_strided", "alias", "detach", "t",
    "transpose", "unsqueeze", "squeeze", "expand", "reshape", "split", "split_with_sizes",
    "unbind", "empty", "empty_like", "new_empty", "empty_strided", "lift_fresh",
}  # fmt: skip
GEMMS = {"mm", "addmm", "bmm", "matmul", "linear", "_mkl_linear"}  # _mkl_linear: packed CPU weights


class _AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched outside Triton's interpreter."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any("triton/runtime/interpreter" in f.filename for f in traceback.extract_stack()):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(tmp_path, num_layers: int) -> Counter[str]:
    model_dir = make_tiny_llama(
        tmp_path / f"l{num_layers}",
        num_layers=num_layers,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    llm = LLM(
        model=str(model_dir),
        attention_backend="triton",
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=4 * 2**20,
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 13, 17, 21]}
    llm.generate([prompt], params, use_tqdm=False)  # warm: tables, compiled paths
    with _AtenOps() as counter:
        outputs = llm.generate([prompt], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 2
    return counter.ops


@pytest.mark.skipif(torch.cuda.is_available(), reason="the op counts are the CPU interpreter's")
def test_a_llama_layer_dispatches_no_aten_elementwise_op(tmp_path, monkeypatch) -> None:
    # The Triton op implementations, as a CUDA device selects them (select_op_impl).
    monkeypatch.setattr(model_loader, "select_op_impl", lambda *args: "triton")
    two, three = _step_ops(tmp_path, 2), _step_ops(tmp_path, 3)
    per_layer = {op: three[op] - two[op] for op in three if three[op] != two[op]}
    assert set(per_layer) & GEMMS, per_layer  # the projections are seen: the count works
    launched = {op: n for op, n in per_layer.items() if op not in NO_KERNEL | GEMMS}
    assert launched == {}, f"aten kernels per layer on the Triton path: {launched}"
