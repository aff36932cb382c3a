"""`pagedserve bench plot`: latency against request rate from several `bench serve` results.

    for rate in 1 2 4 8; do pagedserve bench serve --request-rate $rate --save-result; done
    pagedserve bench plot bench-serve-*.json -o latency_vs_rate.png

One panel per metric (TTFT, TPOT, ITL, E2E latency), its median and a percentile against
the request rate; runs are grouped into lines by their `label`. A run at an infinite rate is
placed at the request throughput it reached. Needs matplotlib (`pip install
pagedserve[bench]`), imported only here.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clients.bench_metrics import METRICS


def request_rate(result: dict[str, Any]) -> float:
    """The x position of a run: its request rate, or its throughput when the rate was inf."""
    rate = float(result.get("request_rate", "inf"))
    return float(result["request_throughput"]) if math.isinf(rate) else rate


def series(results: Sequence[dict[str, Any]], key: str) -> dict[str, list[tuple[float, float]]]:
    """`key` (e.g. "p99_ttft_ms") against the request rate, one sorted line per label."""
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for result in results:
        if key in result:
            lines[str(result.get("label") or "")].append((request_rate(result), result[key]))
    return {label: sorted(points) for label, points in lines.items()}


def plot_results(
    results: Sequence[dict[str, Any]], output: str | Path, percentile: str = "p99"
) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    labels = sorted({str(result.get("label") or "") for result in results})
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for ax, (metric, (title, short)) in zip(axes.flat, METRICS.items()):
        for stat, style in (("median", "-o"), (percentile, "--s")):
            lines = series(results, f"{stat}_{metric}_ms")
            for label, points in lines.items():
                xs, ys = zip(*points)
                color = f"C{labels.index(label)}"  # one colour per label: median and pXX
                ax.plot(xs, ys, style, color=color, label=f"{label} {stat}".strip())
        ax.set_title(f"{title} ({short})")
        ax.set_xlabel("request rate (req/s; inf runs at their throughput)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    output = Path(output)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def add_plot_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="JSON files written by bench serve")
    parser.add_argument("-o", "--output", default="latency_vs_rate.png")
    parser.add_argument(
        "--percentile", default="p99", help="which saved percentile to draw beside the median"
    )


def main_plot(ns: argparse.Namespace) -> int:
    results = [json.loads(Path(path).read_text()) for path in ns.results]
    try:
        path = plot_results(results, ns.output, ns.percentile)
    except ImportError:
        print("error: bench plot needs matplotlib: pip install 'pagedserve[bench]'")
        return 1
    print(f"Plot of {len(results)} runs saved to {path}")
    return 0
