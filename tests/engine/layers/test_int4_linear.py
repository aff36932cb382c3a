"""The INT4 linear method (the CUDA path of AWQ / GPTQ checkpoints), forced on the CPU
through Triton's interpreter: both of its routes against the dequantized weight, the
installer's fusing of shards, and a whole engine on a kept-INT4 checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.config.weights.int4_checkpoint import Int4Scheme
from engine.layers.int4_installer import Int4Installer
from engine.layers.int4_linear import Int4LinearMethod
from engine.layers.linear import Linear
from engine.loader import int4_weights
from engine.loader.int4_packing import gptq_to_int4
from tests.engine.int4_checkpoints import write_int4_checkpoint
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.kernels._helpers import device, requires_cuda
from tests.model_utils import make_tiny_llama
from tests.triton_utils import import_triton

import_triton()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("int4")
    model = make_tiny_llama(
        base / "fp32", hidden_size=128, intermediate_size=256, max_position_embeddings=256
    )
    return {
        "gptq-act-order": write_int4_checkpoint(model, base, "gptq", group_size=32, desc_act=True),
        "awq": write_int4_checkpoint(model, base, "awq", group_size=64),
    }


def _part(quant_dir, prefix, scheme):
    tensors = load_file(quant_dir / "model.safetensors")
    return gptq_to_int4(
        prefix,
        tensors[f"{prefix}.qweight"],
        tensors[f"{prefix}.qzeros"],
        tensors[f"{prefix}.scales"],
        tensors[f"{prefix}.g_idx"],
        scheme,
    )


@pytest.mark.parametrize("rows", [3, 9])
def test_both_routes_match_the_dequantized_weight(checkpoints, rows) -> None:
    """3 rows take the in-kernel dequantization, 9 (past a threshold of 4) the dequantize
    kernel then a matmul; act-order parts gather their input columns."""
    quant_dir, ref_dir = checkpoints["gptq-act-order"]
    scheme = Int4Scheme("gptq", 32, True, 1, True)
    prefix = "model.layers.0.mlp.down_proj"
    part = _part(quant_dir, prefix, scheme)
    method = Int4LinearMethod([part.to(device())], max_kernel_rows=4)
    weight = load_file(ref_dir / "model.safetensors")[f"{prefix}.weight"]
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(weight.shape[0])
    x, weight, bias = x.to(device()), weight.to(device()), bias.to(device())
    torch.testing.assert_close(
        method.apply(x, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4
    )


def test_installer_fuses_shards_in_checkpoint_order(checkpoints) -> None:
    quant_dir, ref_dir = checkpoints["gptq-act-order"]
    scheme = Int4Scheme("gptq", 32, True, 1, True)
    layer = Linear(128, 256, bias=False, output_sizes=(128, 64, 64))
    model = torch.nn.ModuleDict({"self_attn": torch.nn.ModuleDict({"qkv_proj": layer})})
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    installer = Int4Installer(model, packed, device(), lambda name, parts: Int4LinearMethod(parts))
    installer.prepare(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
    assert layer.weight.numel() == 0
    reference = load_file(ref_dir / "model.safetensors")
    for name in ("v_proj", "q_proj", "k_proj"):  # any order
        assert installer(
            f"self_attn.{name}", _part(quant_dir, f"model.layers.0.self_attn.{name}", scheme)
        )
    installer.check_complete()
    assert isinstance(layer.quant_method, Int4LinearMethod)
    assert len(layer.quant_method.parts) == 3  # act-order shards keep their own input order
    expected = torch.cat(
        [reference[f"model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")]
    )
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(0)).to(device())
    torch.testing.assert_close(layer(x), F.linear(x, expected.to(device())), atol=1e-4, rtol=1e-4)
    assert not installer("model.layers.0.mlp.experts.0.w1", layer.quant_method.parts[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-forced path; CUDA's: below")
def test_engine_on_kept_int4_weights_matches_dequantized_loading(checkpoints, monkeypatch) -> None:
    """The engine with every projection kept INT4 (as on CUDA) gives the tokens of the same
    checkpoint dequantized at load (kernels in the interpreter: two short prompts). The CPU
    backend's whole-step decode, which runs only native weights, steps aside."""
    quant_dir, _ = checkpoints["awq"]
    prompts = [[5, 9, 17, 3, 44, 61, 2, 8, 90, 11], [7, 7, 30]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def generate():
        llm = LLM(model=str(quant_dir), device="cpu", dtype="float32", max_model_len=64)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outputs]

    _, dequantized = generate()
    monkeypatch.setattr(int4_weights, "int4_kept_packed", lambda device: True)
    monkeypatch.setattr("engine.layers.int4_linear.INT4_GEMM_MAX_ROWS", 4)  # prefill: dequantize
    llm, kept = generate()
    assert kept == dequantized
    model = llm.llm_engine.executor.runner.model  # one process: the uniproc executor
    methods = [m.quant_method for m in model.modules() if isinstance(m, Linear)]
    assert sum(isinstance(m, Int4LinearMethod) for m in methods) == 8  # 4 fused x 2 layers


@requires_cuda
@pytest.mark.parametrize("case", ["awq", "gptq-act-order"])
def test_engine_on_cuda_matches_transformers(checkpoints, case) -> None:
    """On a GPU the projections stay INT4 by default; the engine (fp32) against transformers
    on the dequantized model."""
    quant_dir, ref_dir = checkpoints[case]
    prompts = [[5, 9, 17, 3, 44, 61, 2, 8, 90, 11], [7, 7, 30], list(range(3, 80))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    llm = LLM(model=str(quant_dir), device="cuda", dtype="float32", max_model_len=256)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = llm.llm_engine.executor.runner.model
    assert any(
        isinstance(m.quant_method, Int4LinearMethod)
        for m in model.modules()
        if isinstance(m, Linear)
    )
    assert_close_to_reference(hf_greedy(ref_dir, prompts, 16), ours_greedy(outputs))
