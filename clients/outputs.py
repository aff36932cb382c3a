"""What the clients return: plain dataclasses built from the API's messages, so callers never
touch protobuf.

    GenerationDelta     one streamed message: the new text and token ids of output `index`
    GenerationResult    a whole answer, deltas put back together (`ResultBuilder`), one
                        `CompletionOutput` per index
    HealthStatus, ModelInfo, TokenizeResult
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.v1 import common_pb2, generation_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0  # in a delta: of its output so far; in a result: of all outputs
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    text: str


@dataclass(slots=True)
class PositionLogprobs:
    """The chosen token's logprob at one position (None for a prompt's first token) and
    the top-k alternatives."""

    chosen: TokenLogprob | None
    top: list[TokenLogprob]


@dataclass(slots=True)
class GenerationDelta:
    """One streamed message: what output `index` gained since its previous message."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort" on the output's last delta
    stop_reason: int | str | None  # the stop token id or stop string it stopped on, if any
    usage: Usage
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # one per new token
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # first delta only
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class CompletionOutput:
    """One of the n outputs of a request, whole."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float | None = None
    num_deltas: int = 0


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    outputs: list[CompletionOutput]  # by index
    usage: Usage
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The first output's text (the whole answer when n = 1)."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def texts(self) -> list[str]:
        return [out.text for out in self.outputs]

    @property
    def token_ids(self) -> list[list[int]]:
        return [out.token_ids for out in self.outputs]

    @property
    def finish_reasons(self) -> list[str | None]:
        return [out.finish_reason for out in self.outputs]


class ResultBuilder:
    """Puts streamed deltas back together into a `GenerationResult`."""

    def __init__(self) -> None:
        self.request_id = ""
        self.outputs: dict[int, CompletionOutput] = {}
        self.usages: dict[int, Usage] = {}
        self.prompt_logprobs: list[PositionLogprobs] = []

    def add(self, delta: GenerationDelta) -> None:
        self.request_id = delta.request_id
        out = self.outputs.setdefault(delta.index, CompletionOutput(delta.index))
        out.text += delta.text
        out.token_ids += delta.token_ids
        out.logprobs += delta.logprobs
        out.num_deltas += 1
        if delta.cumulative_logprob is not None:
            out.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        self.usages[delta.index] = delta.usage
        self.prompt_logprobs += delta.prompt_logprobs

    def add_all(self, deltas: Iterable[GenerationDelta]) -> ResultBuilder:
        for delta in deltas:
            self.add(delta)
        return self

    def result(self) -> GenerationResult:
        usages = list(self.usages.values())
        usage = Usage(
            prompt_tokens=max((u.prompt_tokens for u in usages), default=0),
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_tokens=max((u.cached_tokens for u in usages), default=0),
        )
        outputs = [self.outputs[i] for i in sorted(self.outputs)]
        return GenerationResult(self.request_id, outputs, usage, self.prompt_logprobs)


@dataclass(slots=True)
class HealthStatus:
    healthy: bool
    status: str  # "SERVING", "NOT_SERVING"
    details: dict[str, str]


@dataclass(slots=True)
class ModelInfo:
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    hidden_size: int  # the size of the embeddings `encode` returns
    # The longest request (prompt + output) the KV cache can hold: at most max_model_len.
    effective_max_model_len: int = 0
    max_logprobs: int = 0  # the most logprobs / prompt_logprobs may ask for


@dataclass(slots=True)
class LoraAdapter:
    """A LoRA adapter loaded on every engine replica; requests name it in `lora_name`."""

    lora_name: str
    lora_int_id: int  # the first replica's id for it
    lora_path: str  # the PEFT directory on the engines' hosts


@dataclass(slots=True)
class TokenizeResult:
    token_ids: list[int]
    tokens: list[str]  # the token strings
    max_model_len: int

    @property
    def count(self) -> int:
        return len(self.token_ids)


# ---- from the API's messages ------------------------------------------------------------


def _token_logprob(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, msg.rank, msg.text)


def _positions(msgs: Iterable[common_pb2.PositionLogprobs]) -> list[PositionLogprobs]:
    return [
        PositionLogprobs(
            _token_logprob(m.chosen) if m.HasField("chosen") else None,
            [_token_logprob(t) for t in m.top],
        )
        for m in msgs
    ]


def _stop_reason(msg: generation_pb2.GenerateResponse) -> int | str | None:
    if not msg.HasField("stop_reason"):
        return None
    kind = msg.stop_reason.WhichOneof("kind")
    return None if kind is None else getattr(msg.stop_reason, kind)


def delta_from_proto(msg: generation_pb2.GenerateResponse) -> GenerationDelta:
    return GenerationDelta(
        request_id=msg.request_id,
        index=msg.index,
        text=msg.text,
        token_ids=list(msg.token_ids),
        finish_reason=FINISH_REASONS.get(msg.finish_reason),
        stop_reason=_stop_reason(msg),
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens),
        logprobs=_positions(msg.logprobs),
        prompt_logprobs=_positions(msg.prompt_logprobs),
        cumulative_logprob=(msg.cumulative_logprob if msg.HasField("cumulative_logprob") else None),
    )


def health_from_proto(msg: common_pb2.HealthResponse) -> HealthStatus:
    return HealthStatus(msg.healthy, msg.status, dict(msg.details))


def model_info_from_proto(msg: common_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model=msg.model,
        architecture=msg.architecture,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        eos_token_ids=list(msg.eos_token_ids),
        dtype=msg.dtype,
        device=msg.device,
        block_size=msg.block_size,
        num_kv_blocks=msg.num_kv_blocks,
        hidden_size=msg.hidden_size,
        effective_max_model_len=msg.effective_max_model_len,
        max_logprobs=msg.max_logprobs,
    )


def lora_adapters_from_proto(msg: common_pb2.ListLoraAdaptersResponse) -> list[LoraAdapter]:
    return [LoraAdapter(a.lora_name, a.lora_int_id, a.lora_path) for a in msg.adapters]


def embeddings_from_proto(msg: generation_pb2.EncodeResponse) -> list[list[float]]:
    return [list(e.values) for e in msg.embeddings]


def aborted_ids_from_proto(msg: common_pb2.AbortResponse) -> list[str]:
    return list(msg.aborted_request_ids)


def tokenize_from_proto(msg: generation_pb2.TokenizeResponse) -> TokenizeResult:
    return TokenizeResult(list(msg.token_ids), list(msg.tokens), msg.max_model_len)
