"""start_profile() / stop_profile(): a torch.profiler session written as a Chrome trace to
PAGEDSERVE_TORCH_PROFILER_DIR, with the model's forward in it (vLLM's profiling API)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine import LLM, AsyncLLMEngine, LLMEngine, SamplingParams
from engine.worker.profiler import PROFILER_DIR_ENV
from tests.engine.front.test_engine_api import engine_args, final_tokens
from tests.model_utils import make_tiny_llama

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-prof"), max_position_embeddings=128)


def trace_events(path: Path) -> list[dict]:
    with path.open() as f:
        trace = json.load(f)
    return trace["traceEvents"]


def forward_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("name") == "LlamaForCausalLM.forward"]


def test_llm_profile_writes_a_chrome_trace_with_the_forward(model_dir, tmp_path, monkeypatch):
    """vLLM's example: `llm.start_profile(); llm.generate(...); llm.stop_profile()`."""
    llm = LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=1 << 22)
    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=PROFILER_DIR_ENV):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        llm.stop_profile()
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path / "traces"))
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    unprofiled = llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
    path = llm.stop_profile()
    assert path.parent == tmp_path / "traces" and path.name.endswith(".pt.trace.json")
    assert "rank0" in path.name
    events = trace_events(path)
    forwards = forward_events(events)
    assert forwards, "the model's forward is not in the trace"
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in forwards)
    # The forward's aten ops are in the trace too, inside a forward's time range.
    first = forwards[0]
    inside = [
        e
        for e in events
        if str(e.get("name", "")).startswith("aten::")
        and first["ts"] <= e.get("ts", -1) <= first["ts"] + first["dur"]
    ]
    assert inside
    # Profiling changes nothing, and is off again: a later run adds no trace.
    again = llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
    assert again[0].outputs[0].token_ids == unprofiled[0].outputs[0].token_ids
    assert list((tmp_path / "traces").iterdir()) == [path]


def test_async_engine_profile(model_dir, tmp_path, monkeypatch):
    """`await engine.start_profile()` / `await engine.stop_profile()` on the engine thread."""
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path))

    async def main() -> Path:
        engine = AsyncLLMEngine(LLMEngine.from_engine_args(engine_args(model_dir)))
        try:
            await engine.start_profile()
            await final_tokens(engine, "profiled", max_tokens=3)
            return await engine.stop_profile()
        finally:
            engine.shutdown()

    path = asyncio.run(main())
    assert forward_events(trace_events(path))
