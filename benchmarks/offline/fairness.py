"""Fair sharing between tenants: first come, first served vs the virtual token counter.

    python benchmarks/offline/fairness.py                       # default model, batch of 8
    python benchmarks/offline/fairness.py --num-heavy 300 --plot fairness.png --output fairness.json

One engine (in process, `AsyncLLMEngine`, a small batch: `--max-num-seqs`) runs the same
workload twice, with `fairness="off"` and with `fairness="vtc"`:

- the heavy tenant (a batch job) queues `--num-heavy` long requests at once
  (`--heavy-prompt` random prompt tokens, `--heavy-max-tokens` generated, ignore_eos);
- the light tenant (interactive users) keeps `--light-concurrency` short requests in flight
  (`--light-prompt` / `--light-max-tokens`), one after another, from `--light-delay` s after
  the flood until the heavy tenant is done. With the default half of the batch, its demand
  is its fair share; it gets less, because VTC never preempts: the slot a finished light
  request frees goes to the heavy tenant (whose next request is already waiting), and the
  light user's next request waits for the next heavy request to finish.

Printed per policy: the light tenant's time to first token (p50, p99, over its requests),
Jain's fairness index of the two tenants' weighted served tokens (prompt x1, output x2,
VTC's defaults) over `--window` s windows (mean and min), each tenant's served tokens, when
the heavy tenant's last request finished, and the total throughput (prompt + output tokens
per second, and output tokens per second). The served tokens are the engine's own
`pagedserve:tenant_served_tokens_total`, sampled every `--sample-interval` s; `--plot`
draws them over time for both policies, side by side.

    python benchmarks/offline/fairness.py --weights 2,1 --max-num-seqs 4 --num-heavy 24

`--weights A,B` measures weighted sharing instead: tenant "a" of weight A and tenant "b" of
weight B both flood the engine at once (under "vtc" only) with alike requests
(`--heavy-prompt`, `--heavy-max-tokens`, ignore_eos), b `--num-heavy` of them and a A/B
times as many, so served A:B the floods end together. Printed: a's output tokens over b's
each time another quarter of b's requests has finished (A/B when the weights hold).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

from engine import AsyncLLMEngine, EngineArgs, SamplingParams  # noqa: E402

TENANTS = ("heavy", "light")
WEIGHTS = {"prompt": 1.0, "output": 2.0}  # VTC's defaults, as the engine charges them


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one gets everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


class Run:
    """One policy's run: the engine, the two tenants, the sampled served tokens."""

    def __init__(self, args: argparse.Namespace, policy: str) -> None:
        self.args, self.policy = args, policy
        self.engine = AsyncLLMEngine.from_engine_args(
            EngineArgs(
                model=args.model,
                max_num_seqs=args.max_num_seqs,
                fairness=policy,
                seed=0,
            )
        )
        self.rng = random.Random(args.seed)
        self.vocab = self.engine.engine.config.model_config.vocab_size
        self.light_ttft: list[float] = []
        self.samples: list[tuple[float, dict[str, float]]] = []  # (s, weighted per tenant)
        self.raw: dict[str, dict[str, float]] = {}
        self.heavy_done = asyncio.Event()
        self.heavy_done_s = 0.0  # when the heavy tenant's last request finished
        self.start = 0.0
        self.end = 0.0

    def _prompt(self, length: int) -> dict:
        return {"prompt_token_ids": [self.rng.randrange(3, self.vocab) for _ in range(length)]}

    async def _request(self, tenant: str, request_id: str, prompt_len: int, max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        sent, first = time.perf_counter(), None
        async for _ in self.engine.generate(
            self._prompt(prompt_len), params, request_id, fairness_key=tenant
        ):
            if first is None:
                first = time.perf_counter() - sent
        return first

    async def _heavy(self) -> None:
        a = self.args
        await asyncio.gather(
            *(
                self._request("heavy", f"h{i}", a.heavy_prompt, a.heavy_max_tokens)
                for i in range(a.num_heavy)
            )
        )
        self.heavy_done_s = time.perf_counter() - self.start
        self.heavy_done.set()

    async def _light_user(self, user: int) -> None:
        a = self.args
        await asyncio.sleep(a.light_delay)
        number = 0
        while not self.heavy_done.is_set():
            ttft = await self._request(
                "light", f"l{user}-{number}", a.light_prompt, a.light_max_tokens
            )
            self.light_ttft.append(ttft)
            number += 1

    def _served(self) -> dict[str, dict[str, float]]:
        registry = self.engine.engine.metrics.registry
        name = self.engine.engine.config.model_config.served_model_name
        return {
            tenant: {
                kind: registry.get_sample_value(
                    "pagedserve:tenant_served_tokens_total",
                    {"model_name": name, "tenant": tenant, "kind": kind},
                )
                or 0.0
                for kind in WEIGHTS
            }
            for tenant in TENANTS
        }

    async def _sample(self) -> None:
        while True:
            served = self._served()
            weighted = {t: sum(WEIGHTS[k] * v for k, v in served[t].items()) for t in TENANTS}
            self.samples.append((time.perf_counter() - self.start, weighted))
            await asyncio.sleep(self.args.sample_interval)

    async def run(self) -> dict:
        self.start = time.perf_counter()
        sampler = asyncio.ensure_future(self._sample())
        users = [self._light_user(u) for u in range(self.args.light_concurrency)]
        await asyncio.gather(self._heavy(), *users)
        self.end = time.perf_counter()
        sampler.cancel()
        self.raw = self._served()
        self.samples.append((self.end - self.start, {
            t: sum(WEIGHTS[k] * v for k, v in self.raw[t].items()) for t in TENANTS
        }))  # fmt: skip
        self.engine.shutdown()
        return self.summary()

    def _jain_windows(self) -> list[float]:
        """Jain's index per window while the heavy tenant still had work (both tenants
        active); windows in which nothing was served are skipped."""
        window, values, last = self.args.window, [], self.samples[0]
        for sample in self.samples[1:]:
            if sample[0] - last[0] < window:
                continue
            delta = [sample[1][t] - last[1][t] for t in TENANTS]
            if sum(delta) > 0:
                values.append(jain(delta))
            last = sample
        return values

    def summary(self) -> dict:
        duration = self.end - self.start
        windows = self._jain_windows()
        total = sum(v for t in TENANTS for v in self.raw[t].values())
        output = sum(self.raw[t]["output"] for t in TENANTS)
        return {
            "policy": self.policy,
            "duration_s": duration,
            "heavy_done_s": self.heavy_done_s,
            "light_requests": len(self.light_ttft),
            "light_ttft_p50_s": percentile(self.light_ttft, 50),
            "light_ttft_p99_s": percentile(self.light_ttft, 99),
            "jain_mean": statistics.fmean(windows) if windows else float("nan"),
            "jain_min": min(windows) if windows else float("nan"),
            "served": self.raw,
            "tokens_per_s": total / duration,
            "output_tokens_per_s": output / duration,
            "samples": self.samples,
        }


async def weighted(args: argparse.Namespace) -> list[float]:
    """Both tenants flood at once; a's output tokens over b's at each quarter of b's flood."""
    weight_a, weight_b = (float(w) for w in args.weights.split(","))
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=args.model, max_num_seqs=args.max_num_seqs, fairness="vtc", seed=0)
    )
    rng, vocab = random.Random(args.seed), engine.engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.heavy_max_tokens, ignore_eos=True)
    counts = {"a": round(args.num_heavy * weight_a / weight_b), "b": args.num_heavy}
    received, cuts = {"a": 0, "b": 0}, []

    async def one(tenant: str, weight: float, request_id: str) -> None:
        prompt, seen = [rng.randrange(3, vocab) for _ in range(args.heavy_prompt)], 0
        async for output in engine.generate(
            {"prompt_token_ids": prompt},
            params,
            request_id,
            fairness_key=tenant,
            fairness_weight=weight,
        ):
            num_tokens = len(output.outputs[0].token_ids)  # cumulative outputs
            received[tenant] += num_tokens - seen
            seen = num_tokens
        counts[tenant] -= 1
        if tenant == "b" and counts["b"] % max(1, args.num_heavy // 4) == 0:
            cuts.append(received["a"] / max(1, received["b"]))

    calls = [one("a", weight_a, f"a{i}") for i in range(counts["a"])]
    calls += [one("b", weight_b, f"b{i}") for i in range(counts["b"])]
    rng.shuffle(calls)  # interleaved: neither tenant queues first
    await asyncio.gather(*calls)
    engine.shutdown()
    return cuts


def plot(results: list[dict], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(11, 4), sharey=True, constrained_layout=True)
    for ax, result in zip(axes, results):
        times = [t for t, _ in result["samples"]]
        for index, tenant in enumerate(TENANTS):
            values = [served[tenant] for _, served in result["samples"]]
            ax.plot(times, values, "-", color=f"C{index}", label=tenant)
        ax.set_title(
            f"{result['policy']}: light TTFT p50 {result['light_ttft_p50_s']:.2f} s, "
            f"Jain {result['jain_mean']:.2f}"
        )
        ax.set_xlabel("time (s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("weighted tokens served (prompt x1 + output x2)")
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--num-heavy", type=int, default=200)
    parser.add_argument("--heavy-prompt", type=int, default=128)
    parser.add_argument("--heavy-max-tokens", type=int, default=64)
    parser.add_argument("--light-concurrency", type=int, default=4)
    parser.add_argument("--light-prompt", type=int, default=32)
    parser.add_argument("--light-max-tokens", type=int, default=16)
    parser.add_argument("--light-delay", type=float, default=1.0)
    parser.add_argument("--window", type=float, default=5.0, help="Jain's index window (s)")
    parser.add_argument("--sample-interval", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="PNG of served tokens over time")
    parser.add_argument("--output", default=None, help="JSON of both runs")
    parser.add_argument("--weights", default=None, help="A,B: weighted sharing (see above)")
    args = parser.parse_args()
    if args.weights:
        cuts = asyncio.run(weighted(args))
        print(f"a:b output tokens at each quarter of b's flood (weights {args.weights}):")
        print(" ".join(f"{ratio:.2f}" for ratio in cuts))
        return 0

    results = []
    for policy in ("off", "vtc"):
        results.append(asyncio.run(Run(args, policy).run()))
    header = (
        f"{'policy':>6} {'light reqs':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'Jain mean':>9} "
        f"{'Jain min':>8} {'heavy tok':>9} {'light tok':>9} {'heavy done':>10} {'tok/s':>7} "
        f"{'out tok/s':>9}"
    )
    print(header)
    for r in results:
        heavy, light = (sum(r["served"][t].values()) for t in TENANTS)
        print(
            f"{r['policy']:>6} {r['light_requests']:>10} {r['light_ttft_p50_s']:>8.2f}s "
            f"{r['light_ttft_p99_s']:>8.2f}s {r['jain_mean']:>9.3f} {r['jain_min']:>8.3f} "
            f"{heavy:>9.0f} {light:>9.0f} {r['heavy_done_s']:>9.1f}s {r['tokens_per_s']:>7.1f} "
            f"{r['output_tokens_per_s']:>9.1f}"
        )
    off, vtc = results
    change = 100.0 * (vtc["tokens_per_s"] / off["tokens_per_s"] - 1.0)
    print(f"VTC throughput vs FCFS: {change:+.1f} %")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    if args.plot:
        plot(results, args.plot)
        print(f"plot saved to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
