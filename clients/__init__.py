"""Python clients of pagedserve's public gRPC API (`pagedserve.v1.TextGenerationService`).

They import only grpc and the generated code (`pagedserve.v1`), never `engine/` or
`services/`, so a client installs without torch.

    from clients import Client

    with Client("localhost:50051") as client:
        for delta in client.generate("The capital of France is", max_tokens=16):
            print(delta.text, end="", flush=True)

`Client` (sync) and `AsyncClient` (asyncio) have the same methods: generate (streams
`GenerationDelta`s), generate_text and chat (a whole `GenerationResult`), encode, tokenize,
detokenize, abort, health, model_info. Failures raise `PagedServeError` subclasses.
See docs/clients.md.
"""

from clients.async_client import AsyncClient, AsyncGenerationStream
from clients.channel import NO_RETRY, RetryPolicy
from clients.client import Client, GenerationStream
from clients.errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PagedServeError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
)
from clients.outputs import (
    CompletionOutput,
    GenerationDelta,
    GenerationResult,
    HealthStatus,
    LoraAdapter,
    ModelInfo,
    PositionLogprobs,
    TokenizeResult,
    TokenLogprob,
    Usage,
)

__all__ = [
    "NO_RETRY",
    "AbortedError",
    "AlreadyExistsError",
    "AsyncClient",
    "AsyncGenerationStream",
    "CancelledError",
    "Client",
    "CompletionOutput",
    "DeadlineExceededError",
    "GenerationDelta",
    "GenerationResult",
    "GenerationStream",
    "HealthStatus",
    "InternalError",
    "InvalidArgumentError",
    "LoraAdapter",
    "ModelInfo",
    "NotFoundError",
    "PagedServeError",
    "PositionLogprobs",
    "ResourceExhaustedError",
    "RetryPolicy",
    "TokenLogprob",
    "TokenizeResult",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
]
