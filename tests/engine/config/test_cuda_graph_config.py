"""Which decode batch sizes get a CUDA graph: vLLM's default list, capped by max_num_seqs,
off on CPU and with enforce_eager, and the padding of a batch to its captured size. All of
it is decided without a GPU, so it is checked here."""

from __future__ import annotations

import itertools

import pytest

from engine.config.cuda_graph import (
    DEFAULT_CUDA_GRAPH_SIZES,
    CudaGraphConfig,
    cap_graph_sizes,
    resolve_cuda_graph_config,
)


def test_default_list_is_vllms() -> None:
    sizes = DEFAULT_CUDA_GRAPH_SIZES
    assert sizes[:6] == (1, 2, 4, 8, 16, 24)
    assert sizes[-3:] == (480, 496, 512)
    steps = {b - a for a, b in itertools.pairwise(sizes[3:])}
    assert steps == {8, 16}  # 8 up to 256, 16 above
    assert 248 in sizes and 256 in sizes and 264 not in sizes and 272 in sizes
    assert list(sizes) == sorted(set(sizes))


def test_default_capped_by_max_num_seqs() -> None:
    config = resolve_cuda_graph_config(None, False, "cuda", max_num_seqs=256)
    assert config.capture_sizes[-1] == 256 and len(config.capture_sizes) == 3 + 31 + 1
    # a cap between two listed sizes is added, so batches of 9 and 10 still have a graph
    assert cap_graph_sizes(DEFAULT_CUDA_GRAPH_SIZES, 10) == (1, 2, 4, 8, 10)
    assert cap_graph_sizes(DEFAULT_CUDA_GRAPH_SIZES, 1) == (1,)
    # a cap above the whole list keeps the list: larger batches run eagerly
    assert cap_graph_sizes([1, 2, 4], 1024) == (1, 2, 4)
    assert cap_graph_sizes([8, 2, 2, 4], 4) == (2, 4)


def test_user_list_is_sorted_and_checked() -> None:
    config = resolve_cuda_graph_config([4, 1, 16], False, "cuda:0", max_num_seqs=8)
    assert config.capture_sizes == (1, 4, 8)
    for bad in ([0, 2], [-1], [1.5], [True], "1 2"):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            resolve_cuda_graph_config(bad, False, "cuda", max_num_seqs=8)


def test_off_on_cpu_and_with_enforce_eager() -> None:
    assert not resolve_cuda_graph_config(None, False, "cpu", 256).enabled
    assert not resolve_cuda_graph_config([1, 2], True, "cuda", 256).enabled
    # the list is still checked where it is not used: a typo fails on any machine
    with pytest.raises(ValueError):
        resolve_cuda_graph_config([0], False, "cpu", 256)


def test_padded_size_is_the_next_captured_size() -> None:
    config = CudaGraphConfig((1, 2, 4, 8, 16, 24))
    got = {n: config.padded_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 24, 25)}
    assert got == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 17: 24, 24: 24, 25: None}
    assert config.max_capture_size == 24 and config.enabled
    assert CudaGraphConfig().padded_size(1) is None and CudaGraphConfig().max_capture_size == 0


def test_engine_args_resolve_it(tmp_path) -> None:
    from engine import EngineArgs
    from tests.model_utils import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "tiny", hidden_size=32, num_layers=1)
    config = EngineArgs(model=str(model_dir), device="cpu", cuda_graph_sizes=[1, 2])
    assert config.create_engine_config().cuda_graph_config == CudaGraphConfig()
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineArgs(model=str(model_dir), device="cpu", cuda_graph_sizes=[0]).create_engine_config()
