"""Serving-benchmark statistics from per-request timings (the definitions `vllm bench serve`
uses), and the report table.

    TTFT   time to first token: from sending the request to the first message with tokens
    TPOT   time per output token after the first: (e2e - ttft) / (output_tokens - 1), per
           request with more than one output token
    ITL    inter-token latency: every gap between consecutive streamed messages with tokens
           (a message may carry several tokens), over all requests
    E2EL   end-to-end latency: from sending the request to the end of its stream

Throughputs divide by the benchmark's duration (first request sent to last one done); token
counts and latencies are over successful requests only. Times are kept in seconds and
reported in milliseconds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

METRICS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass(slots=True)
class RequestTiming:
    """What one benchmark request measured (seconds)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between messages after the first
    latency: float = 0.0  # end to end
    start_time: float = 0.0  # since the benchmark's start
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class Distribution:
    """mean / median / std / percentiles of one metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of_seconds(cls, values: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        ms = [v * 1000.0 for v in values]
        if not ms:
            return cls(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
        return cls(
            statistics.fmean(ms),
            statistics.median(ms),
            statistics.pstdev(ms),
            {p: percentile(ms, p) for p in percentiles},
        )


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    distributions: dict[str, Distribution]  # by METRICS key

    def to_dict(self) -> dict[str, Any]:
        """Flat, as `vllm bench serve` saves it: mean_ttft_ms, p99_itl_ms, ..."""
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "duration": self.duration_s,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for key, dist in self.distributions.items():
            out[f"mean_{key}_ms"] = dist.mean
            out[f"median_{key}_ms"] = dist.median
            out[f"std_{key}_ms"] = dist.std
            for p, value in dist.percentiles.items():
                out[f"p{_pct(p)}_{key}_ms"] = value
        return out


def _pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(
    timings: Sequence[RequestTiming], duration_s: float, percentiles: Sequence[float] = (99,)
) -> BenchmarkMetrics:
    ok = [t for t in timings if t.success]
    total_input = sum(t.prompt_len for t in ok)
    total_output = sum(t.output_tokens for t in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    samples = {
        "ttft": [t.ttft for t in ok],
        "tpot": [tpot for t in ok if (tpot := t.tpot) is not None],
        "itl": [gap for t in ok for gap in t.itl],
        "e2el": [t.latency for t in ok],
    }
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(timings) - len(ok),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_throughput=total_output * per_s,
        total_token_throughput=(total_input + total_output) * per_s,
        distributions={k: Distribution.of_seconds(v, percentiles) for k, v in samples.items()},
    )


# ---- the report ---------------------------------------------------------------------------

_WIDTH = 50


def _title(text: str, fill: str) -> str:
    return f"{' ' + text + ' ' if fill == '=' else text:{fill}^{_WIDTH}}"


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value:<10}"


def format_report(
    metrics: BenchmarkMetrics, *, max_concurrency: int | None, request_rate: float
) -> str:
    """The result table (the layout idea of `vllm bench serve`'s)."""
    lines = [
        _title("Serving Benchmark Result", "="),
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
        _row("Maximum request concurrency:", max_concurrency or "unlimited"),
        _row("Request rate (req/s):", "inf" if math.isinf(request_rate) else request_rate),
        _row("Benchmark duration (s):", metrics.duration_s),
        _row("Total input tokens:", metrics.total_input_tokens),
        _row("Total generated tokens:", metrics.total_output_tokens),
        _row("Request throughput (req/s):", metrics.request_throughput),
        _row("Output token throughput (tok/s):", metrics.output_throughput),
        _row("Total token throughput (tok/s):", metrics.total_token_throughput),
    ]
    for key, dist in metrics.distributions.items():
        title, short = METRICS[key]
        lines.append(_title(title, "-"))
        lines.append(_row(f"Mean {short} (ms):", dist.mean))
        lines.append(_row(f"Median {short} (ms):", dist.median))
        lines += [_row(f"P{_pct(p)} {short} (ms):", v) for p, v in dist.percentiles.items()]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
