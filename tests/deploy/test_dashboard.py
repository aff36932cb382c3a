"""The Grafana dashboard (docker/grafana/dashboards/pagedserve.json) queries only metrics the
services export, and the observability profile wires Prometheus to them.

A panel whose metric is renamed or never exported shows "No data" forever and nobody notices,
so every metric name in every panel's PromQL is matched against what a live engine service
and tokenizer service (with API keys, for the per-tenant panels) serve on /metrics.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_compose import _config, _run_compose
from tests.model_utils import make_tiny_llama
from tests.services.conftest import ServiceStack
from tests.services.helpers import gather, request

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "pagedserve.json"
PROMETHEUS = ROOT / "docker" / "prometheus.yml"
KEY = "k" * 32
# A metric name in PromQL: our prefix, then name characters (label names never contain ':').
METRIC = re.compile(r"\bpagedserve:[A-Za-z0-9_:]+")
# Samples of one family carry these suffixes; the family name has none of them.
SUFFIX = re.compile(r"_(total|bucket|sum|count|created)$")


def _family(name: str) -> str:
    return SUFFIX.sub("", name)


def _queried() -> dict[str, set[str]]:
    """{family name: titles of the panels that query it}."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queried: dict[str, set[str]] = {}
    for panel in panels:
        for target in panel["targets"]:
            for name in METRIC.findall(target["expr"]):
                queried.setdefault(_family(name), set()).add(panel["title"])
    return queried


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """The metric families a live engine service and tokenizer service export."""
    folder = tmp_path_factory.mktemp("dashboard")
    keys = folder / "api-keys"
    keys.write_text(f"{KEY} team-a max_streams=8\n")
    stack = ServiceStack(
        make_tiny_llama(folder / "tiny", with_tokenizer=True),
        engine_server_config={"metrics_address": "127.0.0.1:0"},
        tokenizer_server_config={"metrics_address": "127.0.0.1:0", "api_key_file": str(keys)},
    )
    try:
        # One request, so label sets exist (a labelled metric without one exports no sample).
        metadata = (("authorization", f"Bearer {KEY}"),)
        prompt = request(token_ids=[5, 6, 7], max_tokens=3)
        stream = stack.public.Generate(prompt, metadata=metadata)
        assert gather(stream)[0].token_ids
        with pytest.raises(grpc.RpcError):  # and one error, for the errors panel
            gather(stack.public.Generate(request(token_ids=[5], max_tokens=3)))
        families: set[str] = set()
        for server in (stack.engine_server, stack.tokenizer_server):
            port = server.metrics_endpoint.port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            for family in text_string_to_metric_families(text):
                families.add(_family(family.name))
        yield families
    finally:
        stack.close()


def test_the_dashboard_queries_what_the_dashboard_is_for() -> None:
    queried = _queried()
    # Request rate, latencies, tokens/s, queue, KV cache, prefix hits, replicas, tenants,
    # errors: each has a metric in some panel.
    for family in (
        "pagedserve:request_success",
        "pagedserve:time_to_first_token_seconds",
        "pagedserve:time_per_output_token_seconds",
        "pagedserve:e2e_request_latency_seconds",
        "pagedserve:generation_tokens",
        "pagedserve:num_requests_waiting",
        "pagedserve:kv_cache_usage_perc",
        "pagedserve:prefix_cache_hits",
        "pagedserve:engine_replica_num_requests_waiting",
        "pagedserve:tenant_requests",
        "pagedserve:rpc_requests",
    ):
        assert family in queried, family
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    sources = {t["datasource"]["uid"] for p in panels for t in p["targets"]}
    provisioned = yaml.safe_load(
        (ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert sources == {source["uid"] for source in provisioned["datasources"]}


def test_every_metric_a_panel_queries_is_exported(exported: set[str]) -> None:
    missing = {name: sorted(titles) for name, titles in _queried().items() if name not in exported}
    assert missing == {}


def test_the_observability_profile_scrapes_both_services() -> None:
    config = _config(ROOT / "docker-compose.yml")
    assert "prometheus" not in config["services"]  # only with --profile observability
    services = _profile_config()["services"]
    assert {"prometheus", "grafana"} <= set(services)
    scrape = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    targets = {
        job["job_name"]: (sd["names"], sd["port"]) for job in scrape for sd in job["dns_sd_configs"]
    }
    assert targets == {"engine": (["engine"], 9100), "tokenizer": (["tokenizer"], 9100)}
    for name in ("engine", "tokenizer"):
        command = services[name]["command"]
        assert command[command.index("--metrics-port") + 1] == "9100"
    for name in ("prometheus", "grafana"):
        assert all(port["host_ip"] == "127.0.0.1" for port in services[name]["ports"])


def _profile_config() -> dict:
    result = _run_compose("--profile", "observability", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
