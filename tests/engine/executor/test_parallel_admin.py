"""Admin calls reach every rank (`collective_rpc`, real rank processes on CPU): with
tensor_parallel_size=2 and with pipeline_parallel_size=2, a PEFT LoRA adapter is added,
generates the single-process engine's tokens with it, and is removed; sleep and wake-up
give the same tokens; a profile writes one trace per rank. One engine per layout covers
all three (each start costs seconds)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.executor.mp_executor import RankFailedError
from engine.worker.profiler import PROFILER_DIR_ENV
from tests.engine.reference import assert_close_to_reference, ours_greedy
from tests.lora_utils import make_peft_adapter
from tests.model_utils import make_tiny_llama

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
PROMPTS = [[5, 9, 17, 33, 2 + k] for k in range(3)] + [list(range(3, 30))]
# Every target: column-parallel (q, k, v, gate, up) and row-parallel (o, down) shards.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = dict(
    dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 22, enable_lora=True,
    max_lora_rank=4,
)  # fmt: skip


def generate(llm: LLM, lora: LoRARequest | None = None):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return ours_greedy(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=lora))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The model, its adapter, and the single-process engine's tokens with and without it."""
    root = tmp_path_factory.mktemp("parallel-admin")
    model_dir = make_tiny_llama(root / "base", num_layers=2, max_position_embeddings=128)
    make_peft_adapter(model_dir, root / "adapter", rank=4, alpha=8, targets=TARGETS, seed=3)
    lora = LoRARequest("adapter", 1, str(root / "adapter"))
    llm = LLM(str(model_dir), **ENGINE)
    expected_lora, expected_base = generate(llm, lora), generate(llm)
    assert [g.token_ids for g in expected_lora] != [g.token_ids for g in expected_base]
    return model_dir, lora, expected_lora, expected_base, llm


def test_one_process_collective_rpc_calls_the_worker(setup) -> None:
    llm = setup[4]
    executor = llm.llm_engine.executor
    assert executor.collective_rpc("list_loras") == [{1}]
    with pytest.raises(ValueError, match="method must name a public Worker method"):
        executor.collective_rpc("_lora")
    with pytest.raises(ValueError, match="method must name a public Worker method"):
        executor.collective_rpc("no_such_method")


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_admin_calls_reach_every_rank(setup, tmp_path, monkeypatch, tp, pp) -> None:
    model_dir, lora, expected_lora, expected_base, _ = setup
    # Only the call's own timeout may notice the rank stopped at the end.
    monkeypatch.setenv("PAGEDSERVE_RANK_TIMEOUT_S", "600")
    llm = LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    engine = llm.llm_engine
    try:
        # LoRA: each rank loads its shard; the tokens are one process's.
        assert engine.add_lora(lora) is True and engine.add_lora(lora) is False
        assert engine.executor.collective_rpc("list_loras") == [{1}, {1}]
        monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path / "traces"))  # read at start
        llm.start_profile()
        assert_close_to_reference(expected_lora, generate(llm, lora))
        path = llm.stop_profile()
        assert_close_to_reference(expected_base, generate(llm))
        _check_traces(path, tmp_path / "traces")
        assert engine.remove_lora(1) and engine.list_loras() == set()
        # A rank's exception comes back as it is, naming the rank; the engine goes on.
        with pytest.raises(ValueError, match=r"adapter_config\.json is missing") as info:
            engine.add_lora(LoRARequest("bad", 2, str(tmp_path)))
        assert "Raised by rank 0 in Worker.add_lora()." in info.value.__notes__
        assert "rank 0:" in str(info.value.__cause__)
        # Sleep frees every rank's cache (level 2: weights too); tags wake a part at a time.
        llm.sleep(level=1)
        assert engine.is_sleeping() and engine.executor.collective_rpc("is_sleeping") == [True] * 2
        llm.wake_up()
        assert not engine.is_sleeping()
        assert_close_to_reference(expected_base, generate(llm))
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        assert engine.is_sleeping()
        llm.wake_up(["kv_cache"])
        assert not engine.is_sleeping()
        # The reloaded model is hooked again: the adapter (loaded again by its request).
        assert_close_to_reference(expected_lora, generate(llm, lora))
        if pp > 1:
            _call_with_steps_in_flight(engine, expected_base)
        # A rank that does not answer in the call's timeout fails the engine, named.
        os.kill(engine.executor.pids[1], signal.SIGSTOP)
        with pytest.raises(RankFailedError, match=r"ranks \[1\] did not answer list_loras"):
            engine.executor.collective_rpc("list_loras", timeout_s=2.0)
    finally:
        engine.shutdown()


def _check_traces(path, directory) -> None:
    """One Chrome trace per rank, named by rank and the session's shared stamp, each with
    the model's forward in it."""
    traces = sorted(directory.iterdir())
    assert path == traces[0] and [t.name for t in traces] == [
        path.name.replace("rank0", f"rank{r}") for r in (0, 1)
    ]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("name") == "LlamaForCausalLM.forward" for e in events), trace.name


def _call_with_steps_in_flight(engine, expected) -> None:
    """A call while a step is in flight in the pipeline: it runs after that step on every
    rank, and the step's output still comes back to the step loop."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS)
    outputs = {o.request_id: o for o in engine.step() if o.finished}
    assert engine._in_flight, "the pipeline holds a step"
    assert engine.executor.collective_rpc("is_sleeping") == [False, False]
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
    assert_close_to_reference(expected, ours_greedy([outputs[str(i)] for i in range(4)]))
