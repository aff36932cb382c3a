"""LoRA in the engine: one batch mixing the base model and three adapters (different ranks
and targets, one rsLoRA) gives, per prompt, the greedy tokens of transformers with that
adapter merged by PEFT; blocks are cached per adapter; the adapter registry (add / remove /
list / pin, LRU beyond max_cpu_loras) and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.engine.reference import assert_close_to_reference, hf_greedy, ours_greedy
from tests.lora_utils import make_peft_adapter
from tests.model_utils import make_tiny_llama

# name: (rank, alpha, rsLoRA, target modules)
ADAPTERS = {
    "attn-r4": (4, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r8": (8, 16, True, ["gate_proj", "up_proj", "down_proj"]),
    "mixed-r2": (2, 4, False, ["q_proj", "v_proj", "down_proj"]),
}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """The base model, and per adapter: (PEFT adapter dir, PEFT-merged model dir)."""
    root = tmp_path_factory.mktemp("lora-engine")
    base_dir = make_tiny_llama(root / "base", max_position_embeddings=128)
    dirs = {"base": (base_dir, base_dir)}
    for seed, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items(), 1):
        peft_model = make_peft_adapter(
            base_dir, root / name, rank=rank, alpha=alpha, targets=targets, seed=seed,
            use_rslora=rslora,
        )  # fmt: skip
        merged_dir = root / f"{name}-merged"
        peft_model.merge_and_unload().save_pretrained(merged_dir)
        dirs[name] = (root / name, merged_dir)
    return dirs


def lora_request(lora_dirs, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(lora_dirs[name][0]))


def make_llm(lora_dirs, **kwargs) -> LLM:
    args = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 22, enable_lora=True)
    return LLM(model=str(lora_dirs["base"][0]), **{**args, **kwargs})


def test_mixed_batch_equals_peft_merged_transformers(lora_dirs) -> None:
    names = ["base", *ADAPTERS, "attn-r4", "base", "mlp-r8"]
    prompts = [[(7 * i + 3 * k) % 120 + 3 for k in range(5 + 3 * i)] for i in range(len(names))]
    llm = make_llm(lora_dirs, max_loras=3, max_lora_rank=8)
    assert llm.llm_engine.get_lora_config().max_loras == 3
    ids = {name: i for i, name in enumerate(ADAPTERS, 1)}
    requests = [None if n == "base" else lora_request(lora_dirs, n, ids[n]) for n in names]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=requests
    )
    ours = ours_greedy(outputs)
    for name in ["base", *ADAPTERS]:
        rows = [i for i, n in enumerate(names) if n == name]
        reference = hf_greedy(lora_dirs[name][1], [prompts[i] for i in rows], MAX_TOKENS)
        assert_close_to_reference(reference, [ours[i] for i in rows])
    # The adapters do change the output: otherwise this test proves nothing.
    base_alone = hf_greedy(lora_dirs["base"][1], prompts[1:4], MAX_TOKENS)
    assert [g.token_ids for g in base_alone] != [ours[i].token_ids for i in range(1, 4)]


def test_prefix_cache_is_keyed_by_adapter(lora_dirs) -> None:
    llm = make_llm(lora_dirs, max_loras=2, max_lora_rank=8)
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}  # two full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    attn = lora_request(lora_dirs, "attn-r4", 1)
    mlp = lora_request(lora_dirs, "mlp-r8", 2)

    def cached(lora) -> int:
        return llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(attn) == 0
    assert cached(attn) == 32  # the same adapter hits its own blocks
    assert cached(mlp) == 0  # another adapter never shares them
    assert cached(None) == 0  # nor does the base model
    assert cached(None) == 32


def test_adapter_registry(lora_dirs, tmp_path) -> None:
    llm = make_llm(lora_dirs, max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    first, second, third = (lora_request(lora_dirs, name, i) for i, name in enumerate(ADAPTERS, 1))
    assert engine.add_lora(first) is True and engine.add_lora(first) is False
    assert engine.pin_lora(1)
    assert engine.add_lora(second) and engine.list_loras() == {1, 2}
    assert engine.add_lora(third)  # LRU beyond max_cpu_loras: 2 goes, pinned 1 stays
    assert engine.list_loras() == {1, 3}
    assert engine.remove_lora(3) and not engine.remove_lora(3)
    with pytest.raises(ValueError, match="not loaded"):
        engine.pin_lora(9)
    with pytest.raises(ValueError, match="already adapter 'attn-r4'"):
        engine.add_lora(LoRARequest("other", 1, str(lora_dirs["mlp-r8"][0])))
    # A bad adapter is refused when added, with the reason; nothing is left behind.
    with pytest.raises(ValueError, match="greater than max_lora_rank=4"):
        make_llm(lora_dirs, max_lora_rank=4).llm_engine.add_lora(second)
    bad = LoRARequest("missing", 7, str(tmp_path))
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"adapter_config\.json is missing"):
        llm.generate({"prompt_token_ids": [3, 4]}, params, use_tqdm=False, lora_request=bad)
    assert not engine.has_unfinished_requests()
    free = engine.kv_cache_manager.get_num_free_blocks()
    assert free == engine.kv_cache_manager.num_blocks
    # An evicted adapter a request names is loaded again from its path.
    out = llm.generate({"prompt_token_ids": [3, 4]}, params, use_tqdm=False, lora_request=second)
    assert len(out[0].outputs[0].token_ids) == 2 and 2 in engine.list_loras()


def test_max_loras_caps_the_adapters_of_a_batch(lora_dirs) -> None:
    """With max_loras=1, requests of two adapters never share a step; all still finish
    with their own adapter's tokens."""
    llm = make_llm(lora_dirs, max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    manager = llm.llm_engine.runner.lora_manager
    seen: list[set[int]] = []
    real_prepare = manager.prepare

    def recording_prepare(token_adapters):
        seen.append({r.lora_int_id for r, _ in token_adapters if r is not None})
        return real_prepare(token_adapters)

    manager.prepare = recording_prepare
    attn = lora_request(lora_dirs, "attn-r4", 1)
    mlp = lora_request(lora_dirs, "mlp-r8", 2)
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    mixed = llm.generate(prompts, params, use_tqdm=False, lora_request=[attn, mlp, None, mlp])
    assert max(len(ids) for ids in seen) == 1 and {1, 2} <= set().union(*seen)
    alone = [
        llm.generate(p, params, use_tqdm=False, lora_request=r)[0]
        for p, r in zip(prompts, [attn, mlp, None, mlp])
    ]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]


def test_lora_requests_info_metric(lora_dirs) -> None:
    """The gauge the Kubernetes inference gateway reads: running and waiting adapters."""
    from prometheus_client import generate_latest

    llm = make_llm(lora_dirs, max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request(
        "a",
        {"prompt_token_ids": [5, 6]},
        params,
        lora_request=lora_request(lora_dirs, "attn-r4", 1),
    )
    engine.add_request(
        "b", {"prompt_token_ids": [5, 7]}, params, lora_request=lora_request(lora_dirs, "mlp-r8", 2)
    )
    engine.step()
    text = generate_latest(engine.metrics.registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("pagedserve:lora_requests_info{"))
    assert 'max_lora="1"' in line
    assert 'running_lora_adapters="attn-r4"' in line
    assert 'waiting_lora_adapters="mlp-r8"' in line
    while engine.has_unfinished_requests():
        engine.step()
    text = generate_latest(engine.metrics.registry).decode()
    lines = [x for x in text.splitlines() if x.startswith("pagedserve:lora_requests_info{")]
    assert len(lines) == 1 and 'running_lora_adapters=""' in lines[0]
    assert 'waiting_lora_adapters=""' in lines[0]


def test_reloading_an_evicted_adapter_keeps_the_batchs_other_adapters(lora_dirs) -> None:
    llm = make_llm(lora_dirs, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    attn, mlp, mixed = (lora_request(lora_dirs, n, i) for i, n in enumerate(ADAPTERS, 1))
    engine.add_lora(attn)
    engine.add_lora(mlp)
    engine.add_lora(mixed)  # evicts attn (least recently used)
    assert engine.list_loras() == {2, 3}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=[attn, mlp])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
    assert engine.list_loras() == {1, 2}  # attn reloaded; mixed, not in the batch, went
