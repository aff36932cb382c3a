"""Multi-head latent attention on the CPU: KV bytes per token, and the decode step of
DeepSeek-V3-shaped layers against Llama layers of the same hidden size.

1. KV-cache bytes per token (bf16) on the real DeepSeek-V3 shape (61 layers, 128 heads,
   kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128): the latent
   entry against the full keys (nope + rope per head) and values it stands for. Arithmetic.
2. One decode step (every request one token, at a given context) through the engine's model
   runner as it runs (`runner._forward`, the fused paths included), on random weights:
   `--layers` DeepSeek-V3 layers with the real per-head dims, q_lora_rank 1536 and
   kv_lora_rank 512 but `--heads` heads and hidden `--hidden`, dense MLPs only (the MoE is
   left out so that the two stacks differ in attention only), against Llama layers of the
   same hidden size and MLP (head_dim 128, `--kv-heads` KV heads). Milliseconds per step,
   median of `--steps` steps, each configuration measured `--repeats` times.

    .venv/bin/python benchmarks/cpu_paths/mla.py [--hidden 2048] [--heads 16] [--kv-heads 4]
        [--context 1024] [--batches 1,16] [--backend cpu|torch]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.offline.host_machine import cpu_model
from engine.llm import LLM
from engine.worker.inputs import build_step_inputs

DEEPSEEK_V3 = dict(
    num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128,
)  # fmt: skip
BLOCK_SIZE = 16


def kv_bytes_per_token(shape: dict, element_size: int = 2) -> tuple[int, int]:
    """(latent cache, full keys and values) bytes per token over all layers."""
    latent = shape["kv_lora_rank"] + shape["qk_rope_head_dim"]
    key = shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"]
    full = shape["num_attention_heads"] * (key + shape["v_head_dim"])
    layers = shape["num_hidden_layers"]
    return latent * layers * element_size, full * layers * element_size


def write_config(path: Path, args: argparse.Namespace, family: str) -> Path:
    common = dict(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, rms_norm_eps=1e-6,
        max_position_embeddings=4 * args.context, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    if family == "deepseek":
        config = dict(
            common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
            num_key_value_heads=args.heads, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
            first_k_dense_replace=args.layers, n_routed_experts=8, num_experts_per_tok=2,
            n_group=1, topk_group=1, moe_intermediate_size=256, n_shared_experts=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    else:
        config = dict(
            common, architectures=["LlamaForCausalLM"], model_type="llama",
            num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@torch.inference_mode()
def step_ms(llm: LLM, batch: int, context: int, steps: int) -> float:
    """Median milliseconds of one decode step of `batch` requests at `context` tokens."""
    runner = llm.llm_engine.runner
    blocks_per_req = -(-(context + 1) // BLOCK_SIZE)
    requests = [
        ([7], context, list(range(r * blocks_per_req, (r + 1) * blocks_per_req)))
        for r in range(batch)
    ]
    inputs = build_step_inputs(requests, BLOCK_SIZE, runner.device)
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        runner._forward(inputs, runner.kv_caches)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default=None, help="attention backend (default: engine's)")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    latent, full = kv_bytes_per_token(DEEPSEEK_V3)
    print(f"CPU: {cpu_model()}")
    print(
        f"DeepSeek-V3 KV cache per token (bf16, 61 layers): latent {latent} B "
        f"({latent / 2**10:.1f} KiB), full K/V {full} B ({full / 2**20:.2f} MiB): "
        f"{full / latent:.1f}x smaller, {100 * (1 - latent / full):.1f} % saved"
    )
    batches = [int(b) for b in args.batches.split(",")]
    num_blocks = max(batches) * (-(-(args.context + 1) // BLOCK_SIZE)) + 1
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, dict[int, list[float]]] = {}
        for family in ("llama", "deepseek"):
            path = write_config(Path(tmp) / family, args, family)
            llm = LLM(
                model=str(path), load_format="dummy", max_model_len=4 * args.context,
                block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks,
                enable_prefix_caching=False, attention_backend=args.backend,
                skip_tokenizer_init=True, max_num_seqs=max(batches),
            )  # fmt: skip
            runner = llm.llm_engine.runner
            per_token = runner.kv_bytes_per_block // BLOCK_SIZE // args.layers
            print(f"{family}: {per_token} KV bytes per token per layer (fp32 cache)")
            results[family] = {
                b: [step_ms(llm, b, args.context, args.steps) for _ in range(args.repeats)]
                for b in batches
            }
            del llm
        for b in batches:
            ll, ds = results["llama"][b], results["deepseek"][b]
            ratios = sorted(d / lm for d, lm in zip(ds, ll, strict=True))
            print(
                f"batch {b:3d}, context {args.context}: llama {statistics.median(ll):7.2f} ms "
                f"[{min(ll):.2f}-{max(ll):.2f}], deepseek {statistics.median(ds):7.2f} ms "
                f"[{min(ds):.2f}-{max(ds):.2f}], deepseek/llama "
                f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]"
            )


if __name__ == "__main__":
    main()
