"""What serving over gRPC costs: the same offline workload through both services and
through in-process `LLM.generate`.

    python benchmarks/serving/grpc_overhead.py             # 64 prompts x 128 tokens, default model

Random token-id prompts of `--input-len`, `--output-len` greedy tokens each with
`ignore_eos`. First in-process `LLM.generate` (all prompts at once), then the engine and
tokenizer services as child processes (`python -m services engine|tokenizer`, the same
engine arguments) with all prompts streamed at once through the public API by an asyncio
client; every answer must hold the in-process tokens. Prints both throughputs and the ratio
(target: >= 90 %).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from benchmarks.offline.throughput import make_prompts  # noqa: E402
from benchmarks.serving.proc_cpu import free_port  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from services.cli.supervisor import wait_until_serving  # noqa: E402


def run_in_process(args: argparse.Namespace, engine_kwargs: dict) -> tuple[float, list]:
    llm = LLM(model=args.model, **engine_kwargs)
    vocab_size = llm.llm_engine.get_model_config().vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    del llm
    gc.collect()  # give the KV cache back before the engine service takes its own
    return elapsed, [(p, o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]


async def _stream_all(address: str, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

        async def one(prompt: list[int]) -> list[int]:
            request = generation_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=params
            )
            token_ids: list[int] = []
            async for response in stub.Generate(request):
                token_ids += response.token_ids
            return token_ids

        return await asyncio.gather(*(one(p) for p in prompts))


def run_services(args: argparse.Namespace, engine_flags: list[str], expected: list) -> float:
    port, engine_port = free_port(), free_port()
    common = ["--log-level", "WARNING", "--engine-addr", f"127.0.0.1:{engine_port}"]
    if args.model:
        common += ["--model", args.model]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    base = [sys.executable, "-m", "services"]
    children = [
        subprocess.Popen([*base, "engine", *common, *engine_flags], env=env),
        subprocess.Popen([*base, "tokenizer", *common, "--port", str(port)], env=env),
    ]
    address = f"127.0.0.1:{port}"
    try:
        if not wait_until_serving(address, children, timeout=900):
            raise RuntimeError("the services did not become healthy")
        asyncio.run(_stream_all(address, [p for p, _ in expected[:2]], 4))  # warm-up
        prompts = [p for p, _ in expected]
        start = time.perf_counter()
        results = asyncio.run(_stream_all(address, prompts, args.output_len))
        elapsed = time.perf_counter() - start
    finally:
        for child in reversed(children):
            child.terminate()
            child.wait(60)
    mismatches = sum(got != want for got, (_, want) in zip(results, expected))
    assert all(len(r) == args.output_len for r in results)
    if mismatches:
        print(f"warning: {mismatches} answers differ from the in-process tokens")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engine_kwargs = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed,
    }
    engine_flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_kwargs.items()]
    num_tokens = args.num_prompts * args.output_len

    in_process, expected = run_in_process(args, engine_kwargs)
    print(f"    in-process LLM.generate: {num_tokens / in_process:8.1f} output tokens/s ", end="")
    print(f"({in_process:.2f} s)", flush=True)
    served = run_services(args, engine_flags, expected)
    print(f"tokenizer + engine services: {num_tokens / served:8.1f} output tokens/s ", end="")
    print(f"({served:.2f} s)")
    print(f"ratio: {100 * in_process / served:.1f} % of in-process throughput (target >= 90 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
