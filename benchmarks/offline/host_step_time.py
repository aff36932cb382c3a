"""The host's own time per decode step: the engine around a model that costs nothing.

    python benchmarks/offline/host_step_time.py                     # batch 1, 64, 256
    python benchmarks/offline/host_step_time.py --batch-sizes 256 --repeats 3 --profile

A model of one layer, hidden 64, a vocabulary of 1024 and random weights
(`load_format="dummy"`, no tokenizer) makes the forward pass nearly free, so what a step
costs is the host's work around it: scheduling, input preparation, sampling metadata,
output processing and the front end's loop. On a GPU this is the time the device waits
between steps unless it overlaps them (issue 42: ~65 us per request per step before).

Per batch size: `B` requests of `--input-len` token ids (8) and `--output-len` tokens
(64, `ignore_eos`, greedy, or seeded with `--seeded`; `--output-kind` final_only as
`LLM.generate` asks, delta as the engine service streams), added at once to the `LLM`'s
engine; then `step()` until done. Only pure decode steps count (every request past its
prompt). Reported: the median wall and CPU milliseconds per step, per run, and the median
and range over `--repeats` runs (sizes alternate run by run). `--stub-forward` replaces the
forward pass and the greedy argmax by zeros of the right shapes (the real step with the
device's work stubbed): what is left is the host's own time. `--profile` prints the
cProfile of one run per size instead (the top functions by own time).
`--async-scheduling` takes the figures with the engine's async scheduling on (each step()
launches step N+1 and finishes step N; on the CPU the host does the same work, so the
figure tells its own cost: the overlap itself needs a GPU).
`--lora` gives every other request a rank-8 adapter on q_proj and v_proj (random, made
here with PEFT): the steps then also prepare the LoRA hooks' per-token slot index.

One torch thread by default (`--threads`): on a shared machine a parallel region of the
tiny forward waits for a descheduled peer thread, milliseconds that are no part of the
host's work (measured: 0.4 to 4.7 ms per step at batch 1 with 2 threads, run to run).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.api.sampling_params import RequestOutputKind


def _model_dir(root: Path) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config.save_pretrained(root)
    return root


def _adapter(root: Path) -> LoRARequest:
    """A random rank-8 PEFT adapter for `_model_dir`'s shape (its own random base weights:
    the engine's are dummy ones, only the shapes must agree)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.lora_utils import make_peft_adapter

    LlamaForCausalLM(LlamaConfig.from_pretrained(root)).save_pretrained(root / "peft-base")
    make_peft_adapter(
        root / "peft-base", root / "lora", rank=8, alpha=16, targets=["q_proj", "v_proj"],
        seed=0,
    )  # fmt: skip
    return LoRARequest("bench", 1, str(root / "lora"))


def _decode_steps(
    llm: LLM, batch: int, ns: argparse.Namespace, run: int, lora: LoRARequest | None = None
) -> list[tuple[float, float]]:
    """(wall s, CPU s) of each pure decode step of one burst of `batch` requests."""
    engine = llm.llm_engine
    params = SamplingParams(
        max_tokens=ns.output_len, ignore_eos=True,
        temperature=0.8 if ns.seeded else 0.0, seed=run if ns.seeded else None,
        output_kind=RequestOutputKind[ns.output_kind.upper()],
    )  # fmt: skip
    for i in range(batch):
        ids = [(7 * i + j) % 1000 + 3 for j in range(ns.input_len)]
        adapter = lora if i % 2 else None
        engine.add_request(
            f"r{run}-{batch}-{i}", {"prompt_token_ids": ids}, params, lora_request=adapter
        )
    steps: list[tuple[float, float]] = []
    while engine.has_unfinished_requests():
        decode_only = _all_started(engine)  # every request past its prompt
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()
        if decode_only:
            steps.append((time.perf_counter() - wall, time.process_time() - cpu))
    return steps[:-1]  # the last step is short (requests finishing)


def _all_started(engine: object) -> bool:
    scheduler = engine.scheduler  # type: ignore[attr-defined]
    return not scheduler.waiting and all(r.output_token_ids for r in scheduler.running)


def _stub_forward(llm: LLM) -> None:
    """Replaces the device's work by zeros of the right shapes: the forward pass (hidden
    states) and the greedy screen's argmax (token 0 for every greedy row)."""
    runner = llm.llm_engine.executor.runner  # type: ignore[attr-defined]
    hidden_size = runner.config.model_config.hf_config.hidden_size

    def forward(inputs, kv_caches, fused=True):
        return torch.zeros(inputs.input_ids.shape[0], hidden_size)

    runner._forward = forward
    runner.model.greedy_argmax = lambda hidden: torch.zeros(hidden.shape[0], dtype=torch.int64)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--input-len", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeded", action="store_true", help="temperature 0.8 with a seed")
    parser.add_argument(
        "--output-kind", default="final_only", choices=["final_only", "cumulative", "delta"],
        help="final_only as LLM.generate; delta as the engine service streams",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads; 1: the tiny forward does not wait on a descheduled peer thread",
    )  # fmt: skip
    parser.add_argument(
        "--stub-forward", action="store_true",
        help="the model's forward and greedy argmax return zeros: the host's work alone",
    )  # fmt: skip
    parser.add_argument(
        "--async-scheduling", action="store_true",
        help="EngineArgs async_scheduling: a step() launches step N+1, then finishes step N",
    )  # fmt: skip
    parser.add_argument(
        "--lora", action="store_true", help="every other request runs a rank-8 adapter"
    )
    parser.add_argument("--sort", default="tottime", help="the profile's order (cumtime, ...)")
    parser.add_argument("--top", type=int, default=25, help="functions the profile prints")
    parser.add_argument("--profile", action="store_true", help="cProfile one run per size")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(Path(tmp))
        lora = _adapter(model_dir) if ns.lora else None
        lora_args = dict(enable_lora=True, max_lora_rank=8) if ns.lora else {}
        llm = LLM(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
            device="cpu", max_model_len=ns.input_len + ns.output_len + 16,
            max_num_seqs=max(ns.batch_sizes), seed=0, async_scheduling=ns.async_scheduling,
            **lora_args,
        )  # fmt: skip
        if ns.stub_forward:
            _stub_forward(llm)
        _decode_steps(llm, 8, ns, run=-1, lora=lora)  # warm up
        if ns.profile:
            for batch in ns.batch_sizes:
                profiler = cProfile.Profile()
                profiler.enable()
                steps = _decode_steps(llm, batch, ns, run=0, lora=lora)
                profiler.disable()
                print(f"batch {batch}: {len(steps)} decode steps")
                pstats.Stats(profiler).sort_stats(ns.sort).print_stats(ns.top)
            return 0
        walls: dict[int, list[float]] = {b: [] for b in ns.batch_sizes}
        cpus: dict[int, list[float]] = {b: [] for b in ns.batch_sizes}
        for run in range(ns.repeats):
            for batch in ns.batch_sizes:
                steps = _decode_steps(llm, batch, ns, run, lora)
                walls[batch].append(1e3 * statistics.median(w for w, _ in steps))
                cpus[batch].append(1e3 * statistics.median(c for _, c in steps))
    print(f"{'batch':>6} {'wall ms/step':>22} {'CPU ms/step':>22} {'us/request (wall)':>18}")
    for batch in ns.batch_sizes:
        per_request = 1e3 * statistics.median(walls[batch]) / batch
        print(
            f"{batch:>6} {_spread(walls[batch]):>22} {_spread(cpus[batch]):>22} "
            f"{per_request:>18.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
