"""vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`) on the engine service's port:
each RPC against the real server, bad fields, cancellation, KV events, the router gauges."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import threading
import zipfile

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from engine import SamplingParams
from engine.api.block_hash import hash_block_tokens
from engine.core.kv_events import block_hash_to_int64
from tests.services.helpers import token_prompts, wait_for

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED


@pytest.fixture(scope="module")
def vllm(stack) -> vllm_pb2_grpc.VllmEngineStub:
    return vllm_pb2_grpc.VllmEngineStub(stack.engine_channel)


def generate_request(prompt, request_id="", stream=False, **sampling) -> vllm_pb2.GenerateRequest:
    return vllm_pb2.GenerateRequest(
        request_id=request_id or f"v-{id(prompt)}-{stream}",
        tokenized=vllm_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=vllm_pb2.SamplingParams(**sampling),
        stream=stream,
    )


def test_generate_streamed_and_not_match_offline(stack, vllm, offline_llm):
    prompts = token_prompts(2, seed=7)
    expected = offline_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1),
        use_tqdm=False,
    )
    for i, (prompt, exp) in enumerate(zip(prompts, expected)):
        params = {"temperature": 0, "max_tokens": 12, "logprobs": 2, "prompt_logprobs": 1}
        (whole,) = list(vllm.Generate(generate_request(prompt, f"ns-{i}", **params), timeout=60))
        complete = whole.complete
        assert list(complete.output_ids) == exp.outputs[0].token_ids
        assert complete.finish_reason == "length"
        assert complete.prompt_tokens == len(prompt) and complete.completion_tokens == 12
        assert list(complete.output_logprobs.token_ids) == exp.outputs[0].token_ids
        assert len(complete.output_logprobs.top_logprobs[0].token_ids) == 2
        chosen = [lp[t].logprob for t, lp in zip(exp.outputs[0].token_ids, exp.outputs[0].logprobs)]
        assert list(complete.output_logprobs.token_logprobs) == pytest.approx(chosen, abs=1e-4)
        assert not complete.input_logprobs.token_logprobs[0].HasField("value")
        assert complete.input_logprobs.token_logprobs[1].HasField("value")

        responses = list(vllm.Generate(generate_request(prompt, f"s-{i}", True, **params)))
        chunks = [r.chunk for r in responses if r.HasField("chunk")]
        assert len(chunks) > 1 and responses[-1].HasField("complete")
        assert [t for c in chunks for t in c.token_ids] == exp.outputs[0].token_ids
        assert sum(c.completion_tokens for c in chunks) == 12
        assert chunks[0].input_logprobs.token_ids == prompt  # prompt logprobs: first chunk only
        assert not chunks[1].HasField("input_logprobs")
    stack.wait_until_idle()


def test_n_seed_and_stop_token_ids(stack, vllm, offline_llm):
    prompt = token_prompts(1, seed=8)[0]
    params = {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 8}
    exp = offline_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(**params), use_tqdm=False
    )[0]
    responses = list(vllm.Generate(generate_request(prompt, "n2", **params), timeout=60))
    got = {r.complete.index: list(r.complete.output_ids) for r in responses}
    assert got == {o.index: o.token_ids for o in exp.outputs}

    greedy = offline_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0].outputs[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    req = generate_request(prompt, "stop", temperature=0, max_tokens=8, stop_token_ids=[stop_at])
    (reply,) = list(vllm.Generate(req, timeout=60))
    assert reply.complete.finish_reason == "stop"
    assert reply.complete.matched_token_id == stop_at
    assert list(reply.complete.output_ids) == greedy.token_ids[: first + 1]


@pytest.mark.parametrize(
    ("mutate", "code", "field"),
    [
        (lambda r: setattr(r, "text", "hello"), INVALID, "text"),
        (lambda r: r.tokenized.ClearField("input_ids"), INVALID, "input_ids"),
        (lambda r: r.sampling_params.logit_bias.__setitem__(49152, 1.0), INVALID, "logit_bias"),
        (lambda r: setattr(r.sampling_params, "json_schema", "{nope"), INVALID, "json"),
        (lambda r: setattr(r.sampling_params, "regex", "(unclosed"), INVALID, "regex"),
        (lambda r: r.sampling_params.choice.SetInParent(), INVALID, "choice"),
        (lambda r: setattr(r.sampling_params, "truncate_prompt_tokens", 0), INVALID, "truncate"),
        (lambda r: setattr(r.sampling_params, "top_p", 1.5), INVALID, "top_p"),
        (lambda r: r.mm_inputs.mm_hashes.append("h"), UNIMPLEMENTED, "mm_inputs"),
        (lambda r: setattr(r, "kv_transfer_params_json", "{}"), UNIMPLEMENTED, "kv_transfer"),
        (lambda r: setattr(r, "data_parallel_rank", 1), INVALID, "data_parallel_rank"),
        (lambda r: setattr(r, "request_id", ""), INVALID, "request_id"),
        (lambda r: r.tokenized.input_ids.append(49152), INVALID, "tokenized.input_ids"),
    ],
)  # fmt: skip
def test_bad_fields_are_refused_by_name(stack, vllm, mutate, code, field):
    request = generate_request([5, 6, 7], "bad", max_tokens=4)
    mutate(request)
    with pytest.raises(grpc.RpcError) as info:
        list(vllm.Generate(request, timeout=30))
    assert info.value.code() == code
    assert field in info.value.details()
    stack.wait_until_idle()


def test_constraints_stop_strings_and_token_controls_match_offline(stack, vllm, offline_llm):
    """What a gateway such as smg sends (response_format, stop, logit_bias, truncation) is
    enforced as the engine's own SamplingParams: the outputs equal the offline engine's."""
    from engine.structured_output import StructuredOutputsParams

    prompt = token_prompts(1, seed=11)[0]
    tokenizer = offline_llm.get_tokenizer()

    def offline(prompt_ids=prompt, **params) -> list[int]:
        out = offline_llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(**params))
        return list(out[0].outputs[0].token_ids)

    def served(request_id: str, **sampling) -> vllm_pb2.GenerateComplete:
        (reply,) = list(vllm.Generate(generate_request(prompt, request_id, **sampling)))
        return reply.complete

    choice = served("choice", temperature=0.7, seed=3, max_tokens=12)
    choice_req = generate_request(prompt, "choice2", temperature=0.7, seed=3, max_tokens=12)
    choice_req.sampling_params.choice.choices.extend(["yes", "no way"])
    (reply,) = list(vllm.Generate(choice_req, timeout=60))
    expected = offline(
        temperature=0.7, seed=3, max_tokens=12,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no way"]),
    )  # fmt: skip
    assert list(reply.complete.output_ids) == expected
    assert tokenizer.decode(expected, skip_special_tokens=True) in ("yes", "no way")
    assert list(choice.output_ids) != expected  # the constraint changed the answer

    greedy = offline(temperature=0, max_tokens=10, ignore_eos=True)
    # A stop string the greedy answer contains, ending before its last token.
    text = next(t for i in range(2, 8) if (t := tokenizer.decode(greedy[i : i + 2]).strip()))
    stopped = served("stop", temperature=0, max_tokens=10, ignore_eos=True, stop=[text])
    assert stopped.finish_reason == "stop" and stopped.matched_stop_str == text
    assert list(stopped.output_ids) == offline(
        temperature=0, max_tokens=10, ignore_eos=True, stop=[text]
    )
    assert len(stopped.output_ids) < 10

    biased = served("bias", temperature=0, max_tokens=4, ignore_eos=True, logit_bias={7: 100.0})
    assert list(biased.output_ids) == [7, 7, 7, 7]
    truncated = served("trunc", temperature=0, max_tokens=5, truncate_prompt_tokens=3)
    assert truncated.prompt_tokens == 3
    assert list(truncated.output_ids) == offline(prompt[-3:], temperature=0, max_tokens=5)
    stack.wait_until_idle()


def test_cancel_aborts_and_frees_blocks_and_gauges(stack, vllm):
    """A cancelled stream frees its blocks, and the router gauges drop back at once, with
    no further engine step (they used to stay stale until the next request)."""
    registry = stack.engine.metrics_registry
    model = {"model_name": stack.engine.engine.metrics.model_name}

    def gauge(name: str) -> float:
        return registry.get_sample_value(f"pagedserve:{name}", model)

    prompt = token_prompts(1, seed=9)[0] * 4
    call = vllm.Generate(
        generate_request(prompt, "cancel-me", True, max_tokens=400, ignore_eos=True)
    )
    next(call)  # running now
    assert gauge("num_requests_running") == 1 and gauge("kv_cache_usage_perc") > 0
    call.cancel()
    stack.wait_until_idle()
    wait_for(lambda: gauge("num_requests_running") == 0 and gauge("kv_cache_usage_perc") == 0)
    assert gauge("num_requests_waiting") == 0
    info = registry.get_sample_value(
        "pagedserve:cache_config_info",
        {**model, "block_size": "16", "num_gpu_blocks": str(stack.stats().num_total_blocks)},
    )
    assert info == 1


def test_abort_rpc_ends_the_stream(stack, vllm):
    call = vllm.Generate(
        generate_request([11, 12, 13], "abort-me", True, max_tokens=400, ignore_eos=True)
    )
    next(call)
    vllm.Abort(vllm_pb2.AbortRequest(request_ids=["abort-me", "unknown"]), timeout=10)
    last = list(call)[-1]
    assert last.complete.finish_reason == "abort"
    stack.wait_until_idle()


def test_info_loads_health_and_tokenizer(stack, vllm, tiny_model_dir):
    assert vllm.HealthCheck(vllm_pb2.HealthCheckRequest(), timeout=10).healthy
    info = vllm.GetModelInfo(vllm_pb2.GetModelInfoRequest(), timeout=10)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert info.vocab_size == config["vocab_size"]
    assert info.max_context_length == config["max_position_embeddings"]
    assert list(info.architectures) == ["LlamaForCausalLM"] and info.is_generation
    assert 2 in info.eos_token_ids
    for rpc, req in (
        (vllm.StartProfile, smg_common_pb2.StartProfileRequest()),
        (vllm.StopProfile, smg_common_pb2.StopProfileRequest()),
    ):
        with pytest.raises(grpc.RpcError) as info:
            rpc(req, timeout=10)
        assert info.value.code() == UNIMPLEMENTED and "Profile" in info.value.details()
    server = vllm.GetServerInfo(vllm_pb2.GetServerInfoRequest(), timeout=10)
    assert server.block_size == 16 and server.max_num_seqs == 128

    loads = vllm.GetLoads(vllm_pb2.GetLoadsRequest(), timeout=10)
    (load,) = loads.loads
    assert load.max_total_num_tokens == stack.stats().num_total_blocks * 16
    assert load.num_running_reqs == 0 and load.token_usage == 0

    chunks = list(vllm.GetTokenizer(smg_common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        tokenizer = json.loads(archive.read("tokenizer.json"))
    assert tokenizer == json.loads((tiny_model_dir / "tokenizer.json").read_text())

    embed = vllm.Embed(
        vllm_pb2.EmbedRequest(
            request_id="emb", tokenized=vllm_pb2.TokenizedInput(input_ids=[4, 5])
        ),
        timeout=30,
    )
    assert embed.embedding_dim == len(embed.embedding) == 64 and embed.prompt_tokens == 2


def test_kv_events_match_the_cached_blocks(stack, vllm):
    """Stored events carry the KV-cache manager's chained hashes of the prompt's full
    blocks (the ones actually in the pool); a flush sends `cleared`."""
    stack.wait_until_idle()
    assert vllm.FlushCache(smg_common_pb2.FlushCacheRequest(), timeout=10).success
    events: list[smg_common_pb2.KvCacheEvent] = []
    subscription = vllm.SubscribeKvEvents(smg_common_pb2.SubscribeKvEventsRequest(), timeout=60)
    first = next(subscription)  # the snapshot: empty after the flush
    assert first.sequence_number == 0 and not first.events

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for batch in subscription:
                events.extend(batch.events)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    prompt = list(range(100, 150))  # three full blocks of 16, and a partial one
    list(vllm.Generate(generate_request(prompt, "kv", max_tokens=2), timeout=60))
    stack.wait_until_idle()
    num_full = len(prompt) // 16
    expected, parent = [], None
    for i in range(num_full):
        parent = hash_block_tokens(parent, prompt[16 * i : 16 * (i + 1)])
        expected.append(block_hash_to_int64(parent))
    pool = stack.engine.engine.kv_cache_manager.block_pool
    cached = {block_hash_to_int64(h) for h in pool.cached_blocks}

    def stored() -> list[int]:
        return [b.block_hash for e in events if e.HasField("stored") for b in e.stored.blocks]

    wait_for(lambda: set(expected) <= set(stored()))
    assert set(stored()) == cached  # every stored event is a block the pool holds
    first_stored = next(e.stored for e in events if e.HasField("stored"))
    assert list(first_stored.blocks[0].token_ids) == prompt[:16]
    assert not first_stored.HasField("parent_block_hash")

    assert vllm.FlushCache(smg_common_pb2.FlushCacheRequest(), timeout=10).success
    wait_for(lambda: any(e.HasField("cleared") for e in events))
    subscription.cancel()
    reader.join(10)
