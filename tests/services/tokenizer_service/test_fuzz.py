"""Fuzzing both services (hypothesis, a few hundred cases): raw random bytes and random
well-typed messages to every RPC. Every call ends with a status within its deadline, never
UNKNOWN or INTERNAL; afterwards nothing has died, no KV block is held and a normal request
still succeeds. The status is checked, never the time a call took on a loaded machine."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.v1 import common_pb2, engine_pb2, generation_pb2
from tests.services.helpers import gather, request
from tests.services.raw import ENGINE_METHODS, HEALTH_CHECK, PUBLIC_METHODS, call_raw

# Statuses a bad request may get; UNKNOWN / INTERNAL would be a bug on our side.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a valid request for many tokens: the deadline ends it
}
DEADLINE_S = 3.0
FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=True,  # the same cases on every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# The engine's Sleep is left out: a valid message (even an empty one, level 0 = 1) puts the
# session's shared engine to sleep, and every later request would wait for WakeUp. Its bad
# input is tested in test_engine_admin.py.
NOT_FUZZED = {"Sleep"}
FUZZED_ENGINE_METHODS = [m for m in ENGINE_METHODS if m.name not in NOT_FUZZED]
_TARGETS = [("public", m) for m in [*PUBLIC_METHODS, HEALTH_CHECK]] + [
    ("engine", m) for m in [*FUZZED_ENGINE_METHODS, HEALTH_CHECK]
]


def _check(stack, side: str, method, payload: bytes) -> None:
    channel = stack.public_channel if side == "public" else stack.engine_channel
    # The deadline bounds each call (a hung handler ends DEADLINE_EXCEEDED, allowed): what
    # is asserted is the status, never how long it took on a loaded machine.
    responses: list[bytes] = []
    code = call_raw(channel, method, payload, timeout=DEADLINE_S, responses=responses)
    assert code in ALLOWED, (method.path, code, payload[:80])
    if method.name == "GenerateStream":  # each request on the call ends with its own status
        batches = [engine_pb2.EngineStreamBatch.FromString(r) for r in responses]
        ends = [e.end.code for b in batches for e in b.outputs if e.WhichOneof("kind") == "end"]
        allowed = {c.value[0] for c in ALLOWED}
        assert set(ends) <= allowed, (method.path, ends, payload[:80])


@FUZZ
@given(target=st.sampled_from(_TARGETS), payload=st.binary(max_size=96))
def test_random_bytes_to_every_rpc(stack, target, payload):
    _check(stack, *target, payload)


# ---- well-typed messages ------------------------------------------------------------------

_UINT32 = st.one_of(st.integers(0, 20), st.just(2**32 - 1), st.integers(0, 2**32 - 1))
# (No subnormals: the engine turns on flush-to-zero in this process, which hypothesis
# detects and refuses to generate them under.)
_FLOAT = st.one_of(
    st.floats(-3, 3, width=32, allow_subnormal=False),
    st.sampled_from([float("nan"), float("inf"), -1e30]),
)
_TOKEN_IDS = st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 2**32 - 1)), max_size=12)
_TEXT = st.text(max_size=40)


@st.composite
def _sampling_params(draw) -> common_pb2.SamplingParams:
    fields = {
        "n": _UINT32,
        "temperature": _FLOAT,
        "top_p": _FLOAT,
        "top_k": st.integers(-(2**31), 2**31 - 1),
        "min_p": _FLOAT,
        "seed": st.integers(-(2**63), 2**63 - 1),
        "presence_penalty": _FLOAT,
        "repetition_penalty": _FLOAT,
        # Up to 4 generated tokens, or far more than any model: small or refused.
        "max_tokens": st.one_of(st.integers(0, 4), st.integers(5000, 2**32 - 1)),
        "min_tokens": st.integers(0, 4),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.integers(0, 3), _UINT32),
        "prompt_logprobs": st.one_of(st.integers(0, 3), _UINT32),
        "skip_special_tokens": st.booleans(),
    }
    chosen = draw(st.sets(st.sampled_from(sorted(fields)), max_size=6))
    kwargs = {name: draw(fields[name]) for name in chosen}
    kwargs["stop"] = draw(st.lists(_TEXT, max_size=3))
    kwargs["stop_token_ids"] = draw(_TOKEN_IDS)
    return common_pb2.SamplingParams(**kwargs)


_CHAT = st.builds(
    lambda messages, add: generation_pb2.ChatInput(
        messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in messages],
        add_generation_prompt=add,
    ),
    st.lists(
        st.tuples(st.sampled_from(["user", "assistant", "system", "", "bot"]), _TEXT), max_size=4
    ),
    st.booleans(),
)


@st.composite
def _generate_request(draw) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(
        request_id=draw(_TEXT),
        sampling_params=draw(_sampling_params()),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
    )
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "none"]))
    if kind == "text":
        msg.text = draw(_TEXT)
    elif kind == "chat":
        msg.chat.CopyFrom(draw(_CHAT))
    elif kind == "token_ids":
        msg.token_ids.SetInParent()
        msg.token_ids.ids.extend(draw(_TOKEN_IDS))
    return msg


_PUBLIC = {
    "Generate": _generate_request(),
    "Encode": st.builds(
        lambda texts, ids: generation_pb2.EncodeRequest(
            texts=texts, token_ids=[common_pb2.TokenIds(ids=i) for i in ids]
        ),
        st.lists(_TEXT, max_size=3),
        st.lists(_TOKEN_IDS, max_size=2),
    ),
    "Abort": st.builds(lambda ids: common_pb2.AbortRequest(request_ids=ids), st.lists(_TEXT)),
    "Tokenize": st.one_of(
        st.builds(lambda t: generation_pb2.TokenizeRequest(text=t), _TEXT),
        st.builds(lambda c: generation_pb2.TokenizeRequest(chat=c), _CHAT),
    ),
    "Detokenize": st.builds(lambda i: generation_pb2.DetokenizeRequest(token_ids=i), _TOKEN_IDS),
    "GetModelInfo": st.just(common_pb2.GetModelInfoRequest()),
    "Health": st.just(common_pb2.HealthRequest()),
    "LoadLoraAdapter": st.builds(
        lambda name, path: common_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path),
        _TEXT,
        _TEXT,
    ),
    "UnloadLoraAdapter": st.builds(
        lambda name: common_pb2.UnloadLoraAdapterRequest(lora_name=name), _TEXT
    ),
    "ListLoraAdapters": st.just(common_pb2.ListLoraAdaptersRequest()),
}
_ENGINE = {
    "Generate": st.builds(
        lambda rid, ids, params: engine_pb2.EngineGenerateRequest(
            request_id=rid, prompt_token_ids=ids, sampling_params=params
        ),
        _TEXT,
        _TOKEN_IDS,
        _sampling_params(),
    ),
    "GenerateStream": st.builds(
        lambda stream_id, rid, ids, params, abort, timeout_s: engine_pb2.EngineStreamRequest(
            stream_id=stream_id,
            **(
                {"abort": engine_pb2.EngineStreamAbort()}
                if abort
                else {
                    "generate": engine_pb2.EngineGenerateRequest(
                        request_id=rid, prompt_token_ids=ids, sampling_params=params
                    )
                }
            ),
            **({} if timeout_s is None else {"timeout_s": timeout_s}),
        ),
        st.integers(0, 2**64 - 1),
        _TEXT,
        _TOKEN_IDS,
        _sampling_params(),
        st.booleans(),
        st.one_of(st.none(), _FLOAT),
    ),
    "Encode": st.builds(
        lambda rid, ids: engine_pb2.EngineEncodeRequest(request_id=rid, prompt_token_ids=ids),
        _TEXT,
        _TOKEN_IDS,
    ),
    "Abort": _PUBLIC["Abort"],
    "GetModelInfo": _PUBLIC["GetModelInfo"],
    "Health": _PUBLIC["Health"],
    "LoadLoraAdapter": _PUBLIC["LoadLoraAdapter"],
    "UnloadLoraAdapter": _PUBLIC["UnloadLoraAdapter"],
    "ListLoraAdapters": _PUBLIC["ListLoraAdapters"],
    "StartProfile": st.just(engine_pb2.StartProfileRequest()),
    "StopProfile": st.just(engine_pb2.StopProfileRequest()),
    "WakeUp": st.builds(
        lambda tags: engine_pb2.WakeUpRequest(tags=tags),
        st.lists(st.one_of(st.sampled_from(["weights", "kv_cache"]), _TEXT), max_size=3),
    ),
    "IsSleeping": st.just(engine_pb2.IsSleepingRequest()),
}


def test_every_rpc_has_a_message_strategy():
    assert {m.name for m in PUBLIC_METHODS} == set(_PUBLIC)
    assert {m.name for m in FUZZED_ENGINE_METHODS} == set(_ENGINE)


def _typed_cases():
    cases = [("public", m, _PUBLIC[m.name]) for m in PUBLIC_METHODS]
    cases += [("engine", m, _ENGINE[m.name]) for m in FUZZED_ENGINE_METHODS]
    return st.sampled_from(cases).flatmap(
        lambda case: case[2].map(lambda msg: (case[0], case[1], msg))
    )


@FUZZ
@given(case=_typed_cases())
def test_random_messages_to_every_rpc(stack, case):
    side, method, message = case
    _check(stack, side, method, message.SerializeToString())


def test_after_the_fuzzing_everything_still_works(stack):
    # (pytest runs this file's tests in order: this one comes after both fuzzers.)
    assert not stack.engine.errored
    asleep = stack.engine_stub.IsSleeping(engine_pb2.IsSleepingRequest(), timeout=10)
    assert not asleep.is_sleeping
    stack.wait_until_idle(timeout=30)
    out = gather(stack.public.Generate(request(token_ids=[5, 6, 7], max_tokens=4), timeout=30))
    assert len(out[0].token_ids) == 4
    assert stack.public.Health(common_pb2.HealthRequest(), timeout=10).healthy
