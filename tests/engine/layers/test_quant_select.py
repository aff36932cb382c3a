"""The timed trial between the fp32 and int8 routes of quantized layers
(engine/layers/quant_select.py): the choice rules, the accuracy gate, the cache round trip,
the forced route, and the routes a loaded model's layers get."""

from __future__ import annotations

import json

import pytest
import torch

from engine.native import native_kernels_available

pytestmark = pytest.mark.skipif(
    not native_kernels_available(), reason="no C compiler: native kernels unavailable"
)

from engine.api.model_files import CACHE_DIR_ENV  # noqa: E402
from engine.layers import quant_select  # noqa: E402
from engine.layers.method_cache import cache_file, cache_key  # noqa: E402
from engine.layers.quant_select import (  # noqa: E402
    QUANT_ROUTE_ENV,
    ROUTES,
    choose_routes,
    select_routes,
    time_routes,
)
from engine.layers.row_buckets import ROW_BUCKETS  # noqa: E402
from engine.native.quant import QType, QuantizedWeight  # noqa: E402
from engine.native.quant_int8 import Int8Isa, int8_isa  # noqa: E402
from tests.engine.gguf_files import random_blocks  # noqa: E402

needs_route = pytest.mark.skipif(
    native_kernels_available() and int8_isa() == Int8Isa.NONE,
    reason="this CPU has no int8 route (needs AVX2)",
)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(QUANT_ROUTE_ENV, "auto")  # the trial (the default is fp32)


def _weight(qtype=QType.Q4_1, n=48, k=128) -> QuantizedWeight:
    return QuantizedWeight(torch.from_numpy(random_blocks(qtype, n, k, seed=n)), qtype, k)


def test_int8_only_where_it_is_clearly_faster():
    table = [
        {"fp32": 1.0},  # batch 1: never timed for int8
        {"fp32": 1.0, "int8": 0.5},
        {"fp32": 1.0, "int8": 0.99},  # within the margin: a tie stays fp32
        {"fp32": 1.0, "int8": 2.0},
    ]
    assert choose_routes(table) == ("fp32", "int8", "fp32", "fp32")


@needs_route
def test_timing_covers_batched_buckets_only():
    table = time_routes(_weight())
    assert len(table) == len(ROW_BUCKETS)
    assert set(table[0]) == {"fp32"}  # one row: the GEMV / whole-step decode
    for times in table[1:]:
        assert set(times) == set(ROUTES) and all(t > 0 for t in times.values())


@needs_route
def test_an_int8_route_that_disagrees_is_no_candidate(monkeypatch):
    monkeypatch.setattr(quant_select, "INT8_TOLERANCE", 0.0)  # nothing rounds that well
    assert all(set(times) == {"fp32"} for times in time_routes(_weight()))


@needs_route
def test_cache_round_trip_and_no_second_timing(monkeypatch):
    weights = [_weight(), _weight(QType.Q8_0, 32, 64), _weight(QType.Q4_K, 16, 256)]
    first = select_routes(weights)
    assert set(first) == {"Q4_1:48x128", "Q8_0:32x64"}  # Q4_K has no int8 route
    path = cache_file({**cache_key(), "quantized_routes": list(ROUTES)})
    data = json.loads(path.read_text())
    assert {k: tuple(v) for k, v in data["decisions"].items()} == first

    def fail(weight):
        raise AssertionError("a cached shape was timed again")

    monkeypatch.setattr(quant_select, "time_routes", fail)
    assert select_routes(weights) == first
    path.write_text("{not json")  # a corrupt cache is measured again, not trusted
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_DIR_ENV, str(path.parent.parent.parent))
    assert set(select_routes(weights)) == set(first)


@needs_route
def test_forced_route(monkeypatch):
    monkeypatch.setenv(QUANT_ROUTE_ENV, "int8")
    (routes,) = select_routes([_weight()]).values()
    assert routes == ("fp32",) + ("int8",) * (len(ROW_BUCKETS) - 1)
    monkeypatch.setenv(QUANT_ROUTE_ENV, "fp32")
    assert set(*select_routes([_weight()]).values()) == {"fp32"}
    monkeypatch.delenv(QUANT_ROUTE_ENV)  # unset: fp32, the int8 route is opt-in
    assert set(*select_routes([_weight()]).values()) == {"fp32"}
    monkeypatch.setenv(QUANT_ROUTE_ENV, "int4")
    with pytest.raises(ValueError, match=QUANT_ROUTE_ENV):
        select_routes([_weight()])
