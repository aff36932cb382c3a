"""A small synchronous client: stream one chat answer and print it as it arrives.

from clients.chat import stream_chat
stream_chat("localhost:50051", "What is the capital of France?")
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

import grpc

from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


@dataclass
class ChatAnswer:
    text: str
    num_tokens: int
    finish_reason: str  # "stop", "length", "abort"


def stream_chat(
    address: str,
    prompt: str,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    out: TextIO | None = sys.stdout,
    timeout: float | None = None,
) -> ChatAnswer:
    """Sends `prompt` as one user message; writes each text delta to `out` as it streams."""
    request = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatInput(
            messages=[generation_pb2.ChatMessage(role="user", content=prompt)]
        ),
        sampling_params=common_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens),
    )
    parts: list[str] = []
    num_tokens = 0
    finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.TextGenerationServiceStub(channel)
        for response in stub.Generate(request, timeout=timeout):
            parts.append(response.text)
            num_tokens += len(response.token_ids)
            if out is not None and response.text:
                out.write(response.text)
                out.flush()
            if response.finish_reason:
                finish_reason = response.finish_reason
    name = common_pb2.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()
    return ChatAnswer("".join(parts), num_tokens, name)
