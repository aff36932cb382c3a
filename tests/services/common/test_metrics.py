"""The services' Prometheus endpoints, scraped over HTTP after known traffic; the engine
service's periodic stats line; the CLI flags."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.v1 import generation_pb2_grpc
from services.cli.flags import build_parser, flags_from, subparser
from tests.services.conftest import ServiceStack
from tests.services.helpers import gather, request, token_prompts, wait_for
from tests.services.secure import start_engine_server, start_tokenizer_server

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def metrics_stack(tiny_model_dir: Path) -> Iterator[ServiceStack]:
    """A fresh engine (its counters start at 0) behind both services, with /metrics on."""
    stack = ServiceStack(
        tiny_model_dir,
        engine_server_config={"metrics_address": "127.0.0.1:0", "log_stats_interval_s": 0.2},
        tokenizer_server_config={"metrics_address": "127.0.0.1:0"},
    )
    yield stack
    stack.close()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum over the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def test_metrics_count_the_traffic(metrics_stack, caplog):
    stack = metrics_stack
    tokenizer_port = stack.tokenizer_server.metrics_endpoint.port
    engine_port = stack.engine_server.metrics_endpoint.port
    assert value(scrape(tokenizer_port), "pagedserve:engine_backend_up") == 1

    prompts = token_prompts(3, seed=11)
    with caplog.at_level(logging.INFO, logger="engine.observability.stats"):
        outputs = [
            gather(
                stack.public.Generate(
                    request(token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=60
                )
            )[0]
            for p in prompts
        ]
        with pytest.raises(grpc.RpcError) as info:
            gather(stack.public.Generate(request(token_ids=prompts[0], top_p=0.0), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stack.wait_until_idle()
        # Logged from the engine thread (every 0.2 s here) while the requests ran, then
        # once idle: waited for, however late the loaded machine logs it.
        wait_for(lambda: "Running: 0 reqs, Waiting: 0 reqs" in caplog.text, timeout=60)
    assert "Avg prompt throughput" in caplog.text

    public = scrape(tokenizer_port)
    rpcs = "pagedserve:rpc_requests_total"
    assert value(public, rpcs, method="Generate", code="OK") == 3
    assert value(public, rpcs, method="Generate", code="INVALID_ARGUMENT") == 1
    assert value(public, rpcs, method="Generate") == 4
    # The bad top_p is the engine's to reject (one rule, one place): its prompt was read too.
    assert value(public, "pagedserve:tokenization_seconds_count") == 4
    assert value(public, "pagedserve:tokenization_seconds_sum") > 0
    assert value(public, "pagedserve:streamed_tokens_total") == 3 * MAX_TOKENS
    chars = sum(len(out.text) for out in outputs)
    assert value(public, "pagedserve:streamed_text_chars_total") == chars
    assert value(public, "pagedserve:num_inflight_requests") == 0

    engine = scrape(engine_port)
    assert value(engine, rpcs, method="Generate", code="OK") == 3  # the invalid one never came
    assert value(engine, "pagedserve:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert value(engine, "pagedserve:generation_tokens_total") == 3 * MAX_TOKENS
    assert value(engine, "pagedserve:request_success_total", finished_reason="length") == 3
    assert value(engine, "pagedserve:e2e_request_latency_seconds_count") == 3
    assert value(engine, "pagedserve:num_requests_running") == 0
    assert value(engine, "pagedserve:num_requests_waiting") == 0
    assert value(engine, "pagedserve:kv_cache_usage_perc") == 0
    line = stack.loop.run(stack.engine.do_log_stats())  # on the engine thread
    assert line.startswith("Avg prompt throughput: ")


def test_engine_backend_gauge_follows_the_engine(metrics_stack):
    stack = metrics_stack
    port = stack.tokenizer_server.metrics_endpoint.port
    stack.stop_engine_server()
    try:
        wait_for(lambda: value(scrape(port), "pagedserve:engine_backend_up") == 0)
    finally:
        stack.start_engine_server()
    wait_for(lambda: value(scrape(port), "pagedserve:engine_backend_up") == 1)


def test_cli_flags(monkeypatch):
    parser = build_parser()
    ns = parser.parse_args(["engine", "--metrics-port", "9101", "--log-stats-interval", "0"])
    assert (ns.engine_metrics_port, ns.log_stats_interval) == (9101, 0.0)
    assert parser.parse_args(["tokenizer"]).metrics_port == 0  # off by default
    monkeypatch.setenv("PAGEDSERVE_METRICS_PORT", "9100")
    parser = build_parser()
    assert parser.parse_args(["tokenizer"]).metrics_port == 9100
    assert parser.parse_args(["engine"]).engine_metrics_port == 9100
    # `serve` gives each child its own port (the variable is the tokenizer's there).
    ns = parser.parse_args(["serve", "--engine-metrics-port", "9101"])
    engine_flags = flags_from(ns, subparser(parser, "engine"))
    tokenizer_flags = flags_from(ns, subparser(parser, "tokenizer"))
    assert engine_flags[engine_flags.index("--metrics-port") + 1] == "9101"
    assert tokenizer_flags[tokenizer_flags.index("--metrics-port") + 1] == "9100"
    assert "--log-stats-interval" in engine_flags
    assert "--log-stats-interval" not in tokenizer_flags


def _families(port: int) -> set[str]:
    return {name for name, _ in scrape(port)}


def test_vllm_metric_names_on_request(metrics_stack):
    """`--metrics-name-prefix vllm`: the same metrics under vLLM's names (`vllm:...`), so
    dashboards, the endpoint picker and autoscalers made for vLLM find them; nothing else
    changes."""
    stack = metrics_stack
    engine = start_engine_server(stack, metrics_address="127.0.0.1:0", metrics_name_prefix="vllm")
    tokenizer = start_tokenizer_server(
        stack, engine.port, metrics_address="127.0.0.1:0", metrics_name_prefix="vllm"
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{tokenizer.port}") as channel:
            stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
            assert gather(stub.Generate(request(token_ids=[5, 6, 7], max_tokens=2)))[0].token_ids
        for ours, theirs in (
            (stack.engine_server.metrics_endpoint.port, engine.metrics_endpoint.port),
            (stack.tokenizer_server.metrics_endpoint.port, tokenizer.metrics_endpoint.port),
        ):
            renamed = {name.replace("pagedserve:", "vllm:", 1) for name in _families(ours)}
            wait_for(lambda: renamed <= _families(theirs))  # noqa: B023
            assert not [name for name in _families(theirs) if name.startswith("pagedserve:")]
        samples = scrape(engine.metrics_endpoint.port)
        for gauge in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
            assert [name for name, _ in samples if name == f"vllm:{gauge}"], gauge
        assert value(samples, "vllm:request_success_total") >= 1
    finally:
        stack.loop.run(tokenizer.stop(0))
        stack.loop.run(engine.stop(0))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--metrics-name-prefix", "sglang"])
    ns = build_parser().parse_args(["serve", "--metrics-name-prefix", "vllm"])
    for child in ("engine", "tokenizer"):
        flags = flags_from(ns, subparser(build_parser(), child))
        assert flags[flags.index("--metrics-name-prefix") + 1] == "vllm"
