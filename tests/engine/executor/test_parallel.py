"""Tensor and pipeline parallelism on CPU (gloo, real rank processes): the same greedy
tokens as one process, start-up checks with the numbers, and failure handling.

Each parallel engine runs the regimes at once: a small token budget (chunked prefill), a
cache small enough to preempt, and prompts sharing a prefix (prefix-cache hits); the
single-process engine with the same settings is the reference, and DESIGN.md's criterion
applies (equal tokens, or each side's token in the other's top-5 at a divergence).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import psutil
import pytest

from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from engine.executor.mp_executor import RankFailedError
from tests.engine.models.test_engine_correctness import make_prompts
from tests.engine.reference import assert_close_to_reference, ours_greedy
from tests.model_utils import make_tiny_llama, make_tiny_model

MAX_TOKENS = 12
# Chunked prefill (16-token budget), preemption (20 blocks of 4 tokens), prefix caching.
REGIME = dict(max_num_batched_tokens=16, num_gpu_blocks_override=20, block_size=4)

MODELS = {
    # GQA, KV heads divisible by 2; biases on attention and MLP; untied; odd vocabulary.
    "gqa-bias": lambda p: make_tiny_llama(
        p, num_layers=3, vocab_size=131, attention_bias=True, mlp_bias=True
    ),
    # MQA: one KV head, replicated on both TP ranks; tied embeddings.
    "mqa-tied": lambda p: make_tiny_llama(
        p, num_heads=4, num_kv_heads=1, num_layers=2, tie_word_embeddings=True
    ),
    # Phi-3 stores fused qkv / gate_up tensors: each rank cuts its rows out of them.
    "phi3": lambda p: make_tiny_model(p, "Phi3ForCausalLM", num_kv_heads=2),
}

CASES = [
    ("gqa-bias", 2, 1),
    ("gqa-bias", 1, 2),
    ("gqa-bias", 2, 2),
    ("mqa-tied", 2, 1),
    ("mqa-tied", 1, 2),
    ("phi3", 2, 1),
]


def generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per model: its directory, prompts and the single-process outputs (computed once)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            path = MODELS[name](tmp_path_factory.mktemp(name))
            prompts = make_prompts(120)
            llm = LLM(str(path), max_model_len=128, **REGIME)
            outputs = generate(llm, prompts)
            assert llm.llm_engine.scheduler.num_preemptions_total > 0, "the regime must preempt"
            cache[name] = (path, prompts, ours_greedy(outputs))
        return cache[name]

    return get


@pytest.mark.parametrize(("name", "tp", "pp"), CASES, ids=[f"{m}-tp{t}-pp{p}" for m, t, p in CASES])
def test_same_tokens_as_one_process(references, name, tp, pp) -> None:
    path, prompts, expected = references(name)
    llm = LLM(
        str(path), max_model_len=128, tensor_parallel_size=tp, pipeline_parallel_size=pp, **REGIME
    )
    engine = llm.llm_engine
    try:
        config = llm.llm_engine.get_parallel_config()
        assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (tp, pp)
        assert config.distributed_executor_backend == "mp"
        assert_close_to_reference(expected, ours_greedy(generate(llm, prompts)))
        assert engine.scheduler.num_preemptions_total > 0
        assert engine.kv_cache_manager.get_num_free_blocks() == engine.get_cache_config().num_blocks
        pids = engine.executor.pids
        assert len(pids) == tp * pp
    finally:
        engine.shutdown()
    assert not any(psutil.pid_exists(pid) and _alive(pid) for pid in pids), "orphan ranks"
    # Each rank ended by itself when told to, status 0 (not killed after the grace period).
    assert [proc.exitcode for proc in engine.executor._procs] == [0] * (tp * pp)


DEFAULT_MODEL_PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 28, 1345, 314, 216, 33, 42]]
DEFAULT_MODEL_KWARGS = dict(max_model_len=256, kv_cache_memory_bytes=64 << 20, quantization=None)


@pytest.fixture(scope="module")
def default_model_reference():
    """The default model's single-process greedy outputs, computed once for both layouts."""
    llm = LLM(**DEFAULT_MODEL_KWARGS)
    try:
        return ours_greedy(generate(llm, DEFAULT_MODEL_PROMPTS))
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (3, 1)], ids=["pp2", "tp3"])
def test_default_model(default_model_reference, tp, pp) -> None:
    """The default model (30 layers; 9 heads and 3 KV heads, so TP=3 and not 2) in two
    stages or on three TP ranks: the same tokens as one process."""
    llm = LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp, **DEFAULT_MODEL_KWARGS)
    try:
        outputs = ours_greedy(generate(llm, DEFAULT_MODEL_PROMPTS))
        assert_close_to_reference(default_model_reference, outputs)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # The default model: 9 heads, 3 KV heads, 30 layers, intermediate 1536.
        (dict(tensor_parallel_size=2), "num_attention_heads (9) is not divisible by"),
        (dict(tensor_parallel_size=9), "intermediate_size (1536) is not divisible"),
        (dict(pipeline_parallel_size=31), "exceeds num_hidden_layers (30)"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
        (dict(distributed_executor_backend="ray"), "distributed_executor_backend must be"),
        (
            dict(tensor_parallel_size=3, distributed_executor_backend="uni"),
            "distributed_executor_backend='uni' runs one process",
        ),
        (dict(pipeline_parallel_size=2, quantization="gguf"), "quantization='gguf' needs"),
    ],
)
def test_unsplittable_settings_are_refused_with_the_numbers(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(**kwargs).create_engine_config()


@pytest.mark.parametrize("victim", [0, 1], ids=["driver-rank", "other-rank"])
def test_a_killed_rank_fails_the_engine_and_no_rank_outlives_it(tmp_path, victim) -> None:
    """The failure names the rank that was killed, not the survivor whose all-reduce broke
    (which often reports first: "rank 0: ... Connection reset by peer"), whichever rank
    the driver hears from first; every rank is gone afterwards."""
    path = make_tiny_llama(tmp_path / "m", num_layers=2, max_position_embeddings=4096)
    engine = LLMEngine.from_engine_args(
        EngineArgs(str(path), skip_tokenizer_init=True, tensor_parallel_size=2)
    )
    pids = engine.executor.pids
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": [5, 6, 7]}, params)
    for _ in range(3):
        engine.step()
    os.kill(pids[victim], signal.SIGKILL)
    cause = re.escape(f"rank {victim} (pid {pids[victim]}) died (killed by SIGKILL)")
    with pytest.raises(RankFailedError, match=f"^{cause}$"):
        while engine.has_unfinished_requests():  # 3000 tokens: it fails long before
            engine.step()
    _wait_gone(pids)
    engine.shutdown()


def test_a_stopped_rank_is_noticed_while_idle(tmp_path, monkeypatch) -> None:
    """SIGSTOP (a hung rank): its heartbeat stops; the engine fails even with nothing to
    step, naming the stopped rank, and every rank (the stopped one too) is killed."""
    monkeypatch.setenv("PAGEDSERVE_RANK_TIMEOUT_S", "2")
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    engine = LLMEngine.from_engine_args(
        EngineArgs(str(path), skip_tokenizer_init=True, pipeline_parallel_size=2)
    )
    failed = threading.Event()
    engine.add_failure_listener(failed.set)
    pids = engine.executor.pids
    os.kill(pids[0], signal.SIGSTOP)
    assert failed.wait(timeout=120), "the idle engine never noticed the stopped rank"
    with pytest.raises(RankFailedError, match=rf"^rank 0 \(pid {pids[0]}\) has not answered"):
        engine.step()
    _wait_gone(pids)
    engine.shutdown()


def test_virtual_engines_report_their_batches(tmp_path) -> None:
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    engine = LLMEngine.from_engine_args(
        EngineArgs(str(path), skip_tokenizer_init=True, pipeline_parallel_size=2)
    )
    try:
        assert not engine.has_unfinished_requests_for_virtual_engine(0)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, params)
        assert engine.has_unfinished_requests_for_virtual_engine(0)
        finished = set()
        while engine.has_unfinished_requests():
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == {"a"}
        assert not any(engine.has_unfinished_requests_for_virtual_engine(i) for i in (0, 1))
        with pytest.raises(ValueError, match="virtual_engine must be in"):
            engine.has_unfinished_requests_for_virtual_engine(2)
    finally:
        engine.shutdown()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"ranks still alive: {pids}"
        time.sleep(0.05)


def test_structured_outputs_and_drafts_over_ranks(tmp_path) -> None:
    """The grammars stay on the driver, which sends each step's allowed-token rows: a regex
    and a choice, with n-gram drafts verified under the grammar, give the single process's
    tokens on two TP ranks."""
    import re

    from engine.structured_output import StructuredOutputsParams

    model = str(make_tiny_llama(tmp_path / "tiny", with_tokenizer=True))
    regex = r"[a-c ]{8,30}"
    single = LLM(model, kv_cache_memory_bytes=16 << 20)
    ids = list(single.get_tokenizer()("a b c x y z 1 2 3 a b c x y z 1 2 3 a b c").input_ids)
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=10,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        ),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),  # unconstrained
    ]
    prompts = [{"prompt_token_ids": ids}] * 3
    expected = [o.outputs[0] for o in single.generate(prompts, params, use_tqdm=False)]
    parallel = LLM(
        model,
        kv_cache_memory_bytes=16 << 20,
        tensor_parallel_size=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    try:
        got = [o.outputs[0] for o in parallel.generate(prompts, params, use_tqdm=False)]
        assert parallel.llm_engine.scheduler.num_draft_tokens > 0
    finally:
        parallel.llm_engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert re.fullmatch(regex, got[0].text), got[0].text
    assert got[1].text in ("yes", "no", "maybe")
