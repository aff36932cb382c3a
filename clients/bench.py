"""`pagedserve bench serve`: a serving benchmark against the public API (after
`vllm bench serve`). Also `python benchmarks/serving/serve.py`.

    pagedserve bench serve --num-prompts 32 --random-input-len 64 --random-output-len 64 \\
        --request-rate inf --max-concurrency 16 --save-result

Requests come from a dataset (`random`: random token-id prompts of --random-input-len tokens
answered with exactly --random-output-len tokens, `ignore_eos`; lengths vary by
±--random-range-ratio, 0 = fixed). They are sent at --request-rate per second as a Poisson
process (exponential gaps; `inf` sends them all at once), at most --max-concurrency at a
time. Each streamed answer is timed (TTFT, inter-token gaps, end to end; see
`bench_metrics`), and the report prints the throughputs and latency statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.async_client import AsyncClient
from clients.bench_metrics import RequestTiming, compute_metrics, format_report
from clients.cli_common import add_connection_args, connection_kwargs, print_error
from clients.errors import PagedServeError


@dataclass(slots=True)
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, math.floor(mean * (1 - range_ratio)))
    return rng.randint(low, max(low, math.ceil(mean * (1 + range_ratio))))


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of uniformly random token ids; lengths uniform in mean × [1 - r, 1 + r]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    return [
        SampleRequest(
            [rng.randrange(vocab_size) for _ in range(_length(rng, input_len, range_ratio))],
            _length(rng, output_len, range_ratio),
        )
        for _ in range(num_prompts)
    ]


def arrival_times(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """When each request is sent (seconds from the start): a Poisson process of
    `request_rate` per second (the first at 0), or all at 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    rng, at, times = random.Random(seed), 0.0, []
    for _ in range(num):
        times.append(at)
        at += rng.expovariate(request_rate)
    return times


async def send_request(
    client: AsyncClient,
    request: SampleRequest,
    sampling: dict[str, Any],
    timeout: float | None,
    bench_start: float,
) -> RequestTiming:
    """One streamed request, timed."""
    timing = RequestTiming(prompt_len=len(request.prompt_token_ids))
    sent = time.perf_counter()
    timing.start_time = sent - bench_start
    last, num_tokens, finish_reason = sent, 0, None
    try:
        stream = client.generate(
            token_ids=request.prompt_token_ids,
            max_tokens=request.output_len,
            ignore_eos=True,
            timeout=timeout,
            **sampling,
        )
        async with stream:
            async for delta in stream:
                now = time.perf_counter()
                if delta.token_ids:
                    if num_tokens == 0:
                        timing.ttft = now - sent
                    else:
                        timing.itl.append(now - last)
                    last, num_tokens = now, num_tokens + len(delta.token_ids)
                finish_reason = delta.finish_reason or finish_reason
    except PagedServeError as exc:
        timing.error = str(exc)
        return timing
    timing.latency = time.perf_counter() - sent
    timing.output_tokens = num_tokens
    timing.success = finish_reason in ("stop", "length") and num_tokens > 0
    if not timing.success:
        timing.error = f"finish_reason={finish_reason}, {num_tokens} tokens"
    return timing


async def run_requests(
    client: AsyncClient,
    dataset: Sequence[SampleRequest],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    sampling: dict[str, Any] | None = None,
    timeout: float | None = None,
    seed: int = 0,
    progress: Any = None,
) -> tuple[list[RequestTiming], float]:
    """Sends `dataset` at its arrival times; returns the timings (in dataset order) and the
    duration in seconds. `progress` (a tqdm bar) is advanced as requests end."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    sampling = sampling or {}
    start = time.perf_counter()

    async def one(request: SampleRequest) -> RequestTiming:
        async with semaphore or contextlib.nullcontext():
            timing = await send_request(client, request, sampling, timeout, start)
        if progress is not None:
            progress.update(1)
        return timing

    tasks = []
    for request, at in zip(dataset, arrival_times(len(dataset), request_rate, seed)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - start


# ---- the command --------------------------------------------------------------------------


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_connection_args(parser)
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=("random",), default="random")
    data.add_argument("--num-prompts", type=int, default=100, help="(100)")
    data.add_argument("--random-input-len", type=int, default=128, help="prompt tokens (128)")
    data.add_argument("--random-output-len", type=int, default=128, help="output tokens (128)")
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths vary uniformly by ± this fraction (0: fixed lengths)",
    )
    data.add_argument("--seed", type=int, default=0, help="of the prompts and arrivals (0)")
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (inf: all at once; the default)",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="(unlimited)")
    load.add_argument("--temperature", type=float, default=0.0, help="(0: greedy)")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first, untimed")
    load.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    out = parser.add_argument_group("report")
    out.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles to report (99)"
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument("--save-result", action="store_true", help="write the result as JSON")
    out.add_argument(
        "--save-detailed", action="store_true", help="add per-request timings to the JSON"
    )
    out.add_argument("--result-dir", default=".", help="where the JSON goes (.)")
    out.add_argument("--result-filename", default=None, help="(bench-serve-<rate>-<time>.json)")
    out.add_argument("--label", default=None, help="names this run in `bench plot` (the model)")


def _progress_bar(total: int, disabled: bool) -> Any:
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # a client-only install without tqdm: no bar
        return None
    return tqdm(total=total, unit="req")


async def bench_serve(ns: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark `ns` describes; prints the report and returns the result dict."""
    percentiles = [float(p) for p in ns.metric_percentiles.split(",") if p.strip()]
    sampling = {"temperature": ns.temperature}
    async with AsyncClient(**connection_kwargs(ns)) as client:
        info = await client.model_info(timeout=60)
        model = info.model or "default model"
        dataset = random_dataset(
            ns.num_prompts,
            ns.random_input_len,
            ns.random_output_len,
            ns.random_range_ratio,
            info.vocab_size,
            ns.seed,
        )
        print(f"Model: {model} on {info.device} ({info.dtype}), at {ns.address}")
        if ns.num_warmups:
            print(f"Warming up with {ns.num_warmups} requests...")
            await run_requests(client, dataset[:1] * ns.num_warmups, sampling=sampling)
        rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
        print(f"Sending {len(dataset)} requests; request rate {rate}/s, ", end="")
        print(f"max concurrency {ns.max_concurrency or 'unlimited'}")
        bar = _progress_bar(len(dataset), ns.disable_tqdm)
        try:
            timings, duration = await run_requests(
                client,
                dataset,
                request_rate=ns.request_rate,
                max_concurrency=ns.max_concurrency,
                sampling=sampling,
                timeout=ns.request_timeout,
                seed=ns.seed,
                progress=bar,
            )
        finally:
            if bar is not None:
                bar.close()
    metrics = compute_metrics(timings, duration, percentiles)
    print(format_report(metrics, max_concurrency=ns.max_concurrency, request_rate=ns.request_rate))
    result = _result(ns, model, metrics.to_dict(), timings)
    if ns.save_result or ns.save_detailed:
        path = _result_path(ns)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"Result saved to {path}")
    return result


def _result(
    ns: argparse.Namespace, model: str, metrics: dict[str, Any], timings: list[RequestTiming]
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "backend": "pagedserve",
        "address": ns.address,
        "model": model,
        "label": ns.label or model,
        "dataset": ns.dataset,
        "num_prompts": ns.num_prompts,
        "random_input_len": ns.random_input_len,
        "random_output_len": ns.random_output_len,
        "random_range_ratio": ns.random_range_ratio,
        "request_rate": "inf" if math.isinf(ns.request_rate) else ns.request_rate,
        "max_concurrency": ns.max_concurrency,
        "temperature": ns.temperature,
        "seed": ns.seed,
        **metrics,
    }
    errors = [t.error for t in timings if t.error]
    result["errors"] = errors[:20]  # the first few; all of them with --save-detailed
    if ns.save_detailed:
        result.update(
            input_lens=[t.prompt_len for t in timings],
            output_lens=[t.output_tokens for t in timings],
            start_times=[t.start_time for t in timings],
            ttfts=[t.ttft for t in timings],
            itls=[t.itl for t in timings],
            e2els=[t.latency for t in timings],
            errors=[t.error for t in timings],
        )
    return result


def _result_path(ns: argparse.Namespace) -> Path:
    if ns.result_filename:
        return Path(ns.result_dir) / ns.result_filename
    rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
    concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(ns.result_dir) / f"bench-serve-{rate}qps{concurrency}-{stamp}.json"


def main_serve(ns: argparse.Namespace) -> int:
    try:
        result = asyncio.run(bench_serve(ns))
    except (PagedServeError, ValueError) as exc:
        print_error(exc)
        return 1
    return 0 if result["completed"] > 0 else 1  # failures are in the report


def main(argv: Sequence[str] | None = None) -> int:
    """`python benchmarks/serving/serve.py ...`: the same as `pagedserve bench serve ...`."""
    parser = argparse.ArgumentParser(prog="benchmarks/serving/serve.py", description=__doc__)
    add_serve_args(parser)
    return main_serve(parser.parse_args(argv))
