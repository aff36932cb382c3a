"""`kv_cache_dtype`: the setting, the cache it allocates and sizes, the default CPU budget,
and the engine's tokens with a bf16/fp16 cache against the same engine with its fp32 cache
under DESIGN.md's criterion (greedy tokens equal, or each side's token in the other's top-5
at the first divergence) across chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import ctypes
import errno
import gc
import math
import mmap
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from engine.config.kv_cache_dtype import resolve_kv_cache_dtype
from engine.worker import cpu_kv_budget
from engine.worker.cpu_kv_budget import default_cpu_kv_cache_bytes
from engine.worker.kv_memory import lazily_zeroed
from tests.engine.reference import assert_close_to_reference, ours_greedy
from tests.model_utils import make_tiny_llama

MiB = 1 << 20
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("kv") / "m", hidden_size=96, num_heads=6, num_kv_heads=2
    )


# ---- the setting -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [
        ("auto", "float32"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("float16", "float16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("float32", "float32"),
        ("fp32", "float32"),
    ],
)
def test_values_and_aliases_resolve_once(tiny, value, expected):
    config = EngineArgs(
        model=str(tiny), dtype="float32", kv_cache_dtype=value
    ).create_engine_config()
    assert config.cache_config.cache_dtype == expected
    if expected != "float32":
        assert resolve_kv_cache_dtype(value, "bfloat16") == (
            "bfloat16" if value == "auto" else expected
        )


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "bfloat", "", 16])
def test_bad_values_are_refused_naming_the_field(tiny, value):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model=str(tiny), kv_cache_dtype=value).create_engine_config()


def test_a_cache_wider_than_the_model_is_refused(tiny):
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' is wider"):
        EngineArgs(
            model=str(tiny), dtype="bfloat16", kv_cache_dtype="float32"
        ).create_engine_config()


def test_gguf_blocks_kept_on_the_cpu_get_a_float16_cache_by_default():
    """As llama.cpp runs the same file: "auto" is float16 where the GGUF blocks stay
    quantized (the fp32 activations would double the cache), the model dtype elsewhere."""
    assert resolve_kv_cache_dtype("auto", "float32", gguf_blocks_on_cpu=True) == "float16"
    assert resolve_kv_cache_dtype("auto", "bfloat16", gguf_blocks_on_cpu=True) == "bfloat16"
    assert resolve_kv_cache_dtype("float32", "float32", gguf_blocks_on_cpu=True) == "float32"
    default = EngineArgs(device="cpu").create_engine_config()  # the default model's GGUF file
    assert default.model_config.quantization == "gguf"
    assert default.cache_config.cache_dtype == "float16"
    wide = EngineArgs(device="cpu", kv_cache_dtype="float32").create_engine_config()
    assert wide.cache_config.cache_dtype == "float32"
    dequantized = EngineArgs(device="cpu", quantization=None, dtype="float32")
    assert dequantized.create_engine_config().cache_config.cache_dtype == "float32"


def test_cache_allocated_in_the_dtype_holds_twice_the_blocks(tiny):
    budget = 1 << 22  # bytes: small enough that max_num_seqs x max_model_len is not the cap
    runners = {
        dtype: LLMEngine.from_engine_args(
            EngineArgs(
                model=str(tiny),
                dtype="float32",  # "auto" is bf16 on CPUs where bf16 is native
                kv_cache_memory_bytes=budget,
                kv_cache_dtype=dtype,
            )
        ).runner
        for dtype in ("auto", "bfloat16", "float16")
    }
    wide = runners.pop("auto")
    assert all(c.dtype == torch.float32 for c in wide.kv_caches)
    for dtype, narrow in runners.items():
        assert all(c.dtype == getattr(torch, dtype) for c in narrow.kv_caches)
        assert narrow.kv_bytes_per_block * 2 == wide.kv_bytes_per_block
        assert narrow.num_blocks == 2 * wide.num_blocks
        kv_bytes = sum(c.numel() * c.element_size() for c in narrow.kv_caches)
        assert kv_bytes == narrow.num_blocks * narrow.kv_bytes_per_block <= budget


# ---- the default CPU budget --------------------------------------------------------------


def test_default_budget_is_what_the_scheduler_can_use_capped_by_available_memory(monkeypatch):
    monkeypatch.delenv(cpu_kv_budget.CPU_KVCACHE_SPACE_ENV, raising=False)
    gib = 1 << 30
    assert default_cpu_kv_cache_bytes(3 * gib, available_bytes=16 * gib) == 3 * gib
    assert default_cpu_kv_cache_bytes(30 * gib, available_bytes=16 * gib) == 8 * gib
    monkeypatch.setenv(cpu_kv_budget.CPU_KVCACHE_SPACE_ENV, "1.5")  # an explicit setting wins
    assert default_cpu_kv_cache_bytes(30 * gib, available_bytes=16 * gib) == int(1.5 * gib)
    monkeypatch.setenv(cpu_kv_budget.CPU_KVCACHE_SPACE_ENV, "-1")
    with pytest.raises(ValueError, match=cpu_kv_budget.CPU_KVCACHE_SPACE_ENV):
        default_cpu_kv_cache_bytes(gib)


def test_engine_blocks_follow_max_num_seqs_times_max_model_len(tiny, monkeypatch):
    monkeypatch.delenv(cpu_kv_budget.CPU_KVCACHE_SPACE_ENV, raising=False)
    kv_cache_dtype = "bfloat16"
    for max_num_seqs, max_model_len in ((3, 64), (5, 100)):
        runner = LLMEngine.from_engine_args(
            EngineArgs(
                model=str(tiny),
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kv_cache_dtype=kv_cache_dtype,
            )
        ).runner
        assert runner.num_blocks == max_num_seqs * math.ceil(max_model_len / 16)
    # Capped by the memory available: half of it.
    per_block = runner.kv_bytes_per_block
    monkeypatch.setattr(cpu_kv_budget, "available_memory_bytes", lambda: 2 * 7 * per_block + 5)
    runner = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tiny), max_num_seqs=5, max_model_len=100, kv_cache_dtype=kv_cache_dtype
        )
    ).runner
    assert runner.num_blocks == 7


def _resident_bytes(address: int, nbytes: int) -> int | None:
    """Bytes of [address, address + nbytes) backed by memory now (mincore), None if unmapped.

    The mapping's own pages, not the process's RSS: other threads and the allocator move
    the RSS by megabytes between two reads (a CI run saw 4 MiB written grow it by 3)."""
    page = mmap.PAGESIZE
    pages = -(-nbytes // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vector) != 0:
        assert ctypes.get_errno() == errno.ENOMEM
        return None
    return sum(byte & 1 for byte in vector) * page


def test_large_16_bit_cache_is_not_resident_until_written():
    shape = (2, 8192, 16, 4, 64)  # 128 MiB of bf16
    cache = lazily_zeroed(shape, torch.bfloat16)
    assert cache.dtype == torch.bfloat16 and cache.shape == shape and cache.is_contiguous()
    address, nbytes = cache.data_ptr(), cache.numel() * cache.element_size()
    assert address % mmap.PAGESIZE == 0
    assert _resident_bytes(address, nbytes) == 0
    assert not cache[0, :64].any() and not cache[1, -64:].any()
    cache[0, :512].fill_(1.5)  # 4 MiB of blocks written
    resident = _resident_bytes(address, nbytes)
    # The written 4 MiB, plus the 64 rows of 8 KiB read at the end (mapped to the zero page).
    assert 4 * MiB <= resident <= 4 * MiB + 64 * 8 * 1024
    assert cache[0, :512].eq(1.5).all() and not cache[0, 512:600].any()
    del cache
    gc.collect()
    assert _resident_bytes(address, nbytes) is None  # unmapped with the tensor


# ---- tokens against the fp32 cache -------------------------------------------------------

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 30, 2)] + [[7, 1, 9] * 8]
SCENARIOS = {
    "one-batch": {},
    "chunked-small-budget": dict(max_num_batched_tokens=16),
    "preemption-tiny-cache": dict(num_gpu_blocks_override=20),
}


def _generate(model: Path, prompts: list[list[int]], **engine_args) -> tuple[LLM, list]:
    llm = LLM(model=str(model), block_size=4, **engine_args)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs


@pytest.mark.parametrize(
    "scenario,attention_backend",
    [(name, None) for name in SCENARIOS]  # the default (native) backend
    + [("chunked-small-budget", "torch"), ("preemption-tiny-cache", "torch")],
)
def test_bf16_cache_tokens_match_the_fp32_cache(tiny, scenario, attention_backend):
    args = dict(SCENARIOS[scenario], attention_backend=attention_backend)
    _, reference = _generate(tiny, PROMPTS, **args)
    llm, outputs = _generate(tiny, PROMPTS, kv_cache_dtype="bfloat16", **args)
    assert llm.llm_engine.runner.kv_caches[0].dtype == torch.bfloat16
    if scenario == "preemption-tiny-cache":
        assert llm.llm_engine.scheduler.num_preemptions_total > 0, "no preemption happened"
    assert_close_to_reference(ours_greedy(reference), ours_greedy(outputs))


def test_fp16_cache_with_prefix_cache_hits_matches_the_fp32_cache(tiny):
    """A shared 24-token prefix: the second batch's requests read its blocks back from the
    cache (hits), and give the tokens of a miss."""
    prefix = [11, 4, 29, 8] * 6
    prompts = [[*prefix, 5, 6], [*prefix, 40], [*prefix, 3, 9, 12]]
    _, reference = _generate(tiny, prompts, enable_prefix_caching=False)
    for kv_cache_dtype in ("float16", "bfloat16"):
        llm, _ = _generate(tiny, prompts[:1], kv_cache_dtype=kv_cache_dtype)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(o.num_cached_tokens >= 24 for o in outputs)
        assert_close_to_reference(ours_greedy(reference), ours_greedy(outputs))


def test_sleep_and_wake_up_reallocate_the_cache_in_its_dtype(tiny):
    llm, before = _generate(tiny, PROMPTS[:2], kv_cache_dtype="bfloat16")
    runner = llm.llm_engine.runner
    blocks = runner.num_blocks
    llm.sleep(level=1)
    assert runner.kv_caches == []
    llm.wake_up()
    assert [c.dtype for c in runner.kv_caches] == [torch.bfloat16] * len(runner.kv_caches)
    assert runner.num_blocks == blocks
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    after = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


@pytest.mark.slow
def test_default_model_with_a_bf16_cache_matches_its_fp32_cache():
    common = dict(kv_cache_memory_bytes=256 * MiB, max_num_batched_tokens=16, max_num_seqs=8)
    fp32 = LLM(**common)
    tokenizer = fp32.get_tokenizer()
    texts = [  # the second prompt is prefilled in chunks (max_num_batched_tokens=16)
        "The capital of France is",
        "Here is a short story about a robot who learns to paint. Once upon a time, in a "
        "small workshop at the edge of a quiet town, there lived a robot",
    ]
    prompts = [{"prompt_token_ids": tokenizer(t).input_ids} for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    reference = fp32.generate(prompts, params, use_tqdm=False)
    del fp32
    bf16 = LLM(kv_cache_dtype="bfloat16", **common)
    assert bf16.llm_engine.runner.kv_caches[0].dtype == torch.bfloat16
    outputs = bf16.generate(prompts, params, use_tqdm=False)
    assert_close_to_reference(ours_greedy(reference), ours_greedy(outputs))
