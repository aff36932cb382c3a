from pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "priority", "trace_headers", "cache_salt", "lora_name", "resumed_output_token_ids", "fairness_key", "fairness_weight")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ResumedOutputTokenIdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _common_pb2.TokenIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_KEY_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    priority: int
    trace_headers: _containers.ScalarMap[str, str]
    cache_salt: str
    lora_name: str
    resumed_output_token_ids: _containers.MessageMap[int, _common_pb2.TokenIds]
    fairness_key: str
    fairness_weight: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., resumed_output_token_ids: _Optional[_Mapping[int, _common_pb2.TokenIds]] = ..., fairness_key: _Optional[str] = ..., fairness_weight: _Optional[float] = ...) -> None: ...

class EngineGenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "finish_reason", "stop_reason", "usage", "prompt_logprobs", "cumulative_logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_reason: _common_pb2.StopReason
    usage: _common_pb2.Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    cumulative_logprob: float
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class EngineStreamRequest(_message.Message):
    __slots__ = ("stream_id", "generate", "abort", "timeout_s")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    generate: EngineGenerateRequest
    abort: EngineStreamAbort
    timeout_s: float
    def __init__(self, stream_id: _Optional[int] = ..., generate: _Optional[_Union[EngineGenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[EngineStreamAbort, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class EngineStreamAbort(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStreamBatch(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineStreamOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineStreamOutput, _Mapping]]] = ...) -> None: ...

class EngineStreamOutput(_message.Message):
    __slots__ = ("stream_id", "response", "end")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: EngineGenerateResponse
    end: EngineStreamEnd
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[EngineGenerateResponse, _Mapping]] = ..., end: _Optional[_Union[EngineStreamEnd, _Mapping]] = ...) -> None: ...

class EngineStreamEnd(_message.Message):
    __slots__ = ("code", "message", "trailing_metadata")
    class TrailingMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    trailing_metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., trailing_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EngineEncodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "pooling_params", "priority", "trace_headers", "cache_salt", "lora_name", "fairness_key", "fairness_weight")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_KEY_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pooling_params: _common_pb2.PoolingParams
    priority: int
    trace_headers: _containers.ScalarMap[str, str]
    cache_salt: str
    lora_name: str
    fairness_key: str
    fairness_weight: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., pooling_params: _Optional[_Union[_common_pb2.PoolingParams, _Mapping]] = ..., priority: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., fairness_key: _Optional[str] = ..., fairness_weight: _Optional[float] = ...) -> None: ...

class EngineEncodeResponse(_message.Message):
    __slots__ = ("request_id", "embedding", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embedding: _containers.RepeatedScalarFieldContainer[float]
    usage: _common_pb2.Usage
    def __init__(self, request_id: _Optional[str] = ..., embedding: _Optional[_Iterable[float]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("trace_paths",)
    TRACE_PATHS_FIELD_NUMBER: _ClassVar[int]
    trace_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trace_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("is_sleeping",)
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    is_sleeping: bool
    def __init__(self, is_sleeping: _Optional[bool] = ...) -> None: ...
