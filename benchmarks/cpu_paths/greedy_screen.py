"""The greedy screen (engine/layers/greedy_screen.py) against the fp32 LM head.

    python benchmarks/cpu_paths/greedy_screen.py                        # fp32 and GGUF, 3 repeats
    python benchmarks/cpu_paths/greedy_screen.py --quantization auto --repeats 5

For each engine (`--quantization`: none = fp32 weights, auto = the default GGUF blocks):
1. the head alone on hidden states captured from the engine's own run: the model's
   `compute_logits` + the sampler's native argmax (a step without the screen) against
   `greedy_argmax`, at 1, 16 and 64 rows, interleaved, medians;
2. issue 13's offline workload (64 chat prompts, 128 greedy tokens each, `ignore_eos`)
   with the screen on and off in the same engine, alternating, every run on a cold
   prefix cache; the tokens of both must be identical.
Prints the CPU model and the kernels' ISA path (`--emulate-isa avx2`: the AVX2 screen on
an AVX-512 CPU, with torch, MKL and oneDNN capped too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout first, not this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch

from benchmarks.offline.chat_prompts import chat_prompts
from benchmarks.offline.host_machine import add_emulate_isa_argument, cpu_model, reexec_with_isa
from engine import LLM, SamplingParams
from engine.sample.sampler import native_argmax


def _generate(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if not llm.llm_engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset")
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def _head_alone(model, hidden: torch.Tensor, repeats: int) -> None:
    for wanted in (1, 16, 64):
        h = hidden[:wanted].contiguous()
        rows = h.shape[0]  # fewer with fewer prompts than rows wanted
        full, screened = [], []
        agree = int((native_argmax(model.compute_logits(h)) == model.greedy_argmax(h)).sum())
        for _ in range(repeats):
            start = time.perf_counter()
            native_argmax(model.compute_logits(h))
            full.append(time.perf_counter() - start)
            start = time.perf_counter()
            model.greedy_argmax(h)
            screened.append(time.perf_counter() - start)
        a, b = statistics.median(full) * 1e3, statistics.median(screened) * 1e3
        print(f"  head, {rows:2d} rows: logits + argmax {a:6.2f} ms, screen {b:6.2f} ms", end="")
        print(f" ({a / b:.2f}x); same tokens {agree}/{rows}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", nargs="+", default=["none", "auto"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    add_emulate_isa_argument(parser)
    args = parser.parse_args()
    if args.emulate_isa:
        reexec_with_isa(args.emulate_isa)
    from engine.native.quant import active_isa

    print(
        f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, ",
        end="",
    )
    print(
        f"kernels {active_isa().name}"
        + (f" (capped: {args.emulate_isa})" if args.emulate_isa else "")
    )
    for quantization in args.quantization:
        llm = LLM(quantization=None if quantization == "none" else quantization)
        model = llm.llm_engine.runner.model
        screen = model.greedy_screen
        name = llm.llm_engine.get_model_config().quantization or "fp32"
        if screen is None:
            print(f"{name}: no greedy screen here (portable kernels); nothing to compare")
            continue
        prompts = chat_prompts(llm.llm_engine.get_model_config().model_dir, args.num_prompts)
        captured: list[torch.Tensor] = []
        argmax, num_rows = screen.argmax, len(prompts)

        def capture(hidden: torch.Tensor, argmax=argmax, rows=num_rows, out=captured):
            if hidden.shape[0] == rows:
                out.append(hidden.clone())
            return argmax(hidden)

        screen.argmax = capture
        _generate(llm, prompts, 16)  # warm-up; captures 64-row hidden states
        screen.argmax = argmax
        print(f"{name} (greedy screen packed: {screen.weights.nbytes / 2**20:.1f} MiB)")
        _head_alone(model, captured[-1], 30)
        times: dict[str, list[float]] = {"on": [], "off": []}
        tokens: dict[str, list] = {}
        for repeat in range(args.repeats):
            for setting in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
                model.greedy_screen = screen if setting == "on" else None
                elapsed, tokens[setting] = _generate(llm, prompts, args.output_len)
                times[setting].append(elapsed)
        model.greedy_screen = screen
        same = sum(a == b for a, b in zip(tokens["on"], tokens["off"]))
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        out_tokens = len(prompts) * args.output_len
        runs = {k: " / ".join(f"{t:.1f}" for t in v) for k, v in times.items()}
        print(f"  offline, screen off: {out_tokens / off:6.1f} tok/s (runs {runs['off']} s)")
        print(f"  offline, screen on:  {out_tokens / on:6.1f} tok/s (runs {runs['on']} s)")
        print(f"  ratio {off / on:.3f}x; identical outputs {same}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
