"""An `LLM` with tensor-parallel rank processes that its user drops (`del llm;
gc.collect()`) stops its ranks then, not when the interpreter exits: nothing outside the
engine (the rank monitor thread included) keeps the executor alive, and a finalizer stops
the processes. Real rank processes (gloo on CPU), started both ways
(`PAGEDSERVE_WORKER_MULTIPROC_METHOD`: forked from the preloaded forkserver, or spawned)."""

from __future__ import annotations

import gc
import time

import psutil
import pytest

from engine import LLM, SamplingParams
from engine.executor.start_method import WORKER_MULTIPROC_METHOD_ENV, default_start_method
from tests.model_utils import make_tiny_llama


def _running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


METHODS = sorted({default_start_method(), "spawn"})


@pytest.mark.parametrize("method", METHODS)
def test_a_collected_llm_stops_its_rank_processes(tmp_path, monkeypatch, method) -> None:
    monkeypatch.setenv(WORKER_MULTIPROC_METHOD_ENV, method)
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    llm = LLM(str(path), skip_tokenizer_init=True, tensor_parallel_size=2)
    assert llm.llm_engine.executor.start_method == method
    pids = llm.llm_engine.executor.pids
    params = SamplingParams(temperature=0.0, max_tokens=4)
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs
    assert len(_running(pids)) == 2
    del llm
    gc.collect()
    # The ranks get 5 s to exit before they are killed; 60 s is only the test's patience.
    deadline = time.monotonic() + 60
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(pids) == []
