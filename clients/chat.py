"""Stream one chat answer and print it as it arrives (the `pagedserve serve` demo).

from clients.chat import stream_chat
stream_chat("localhost:50051", "What is the capital of France?")
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TextIO

from clients.client import Client


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
    **client: Any,
) -> ChatAnswer:
    """Sends `prompt` as one user message; writes each text delta to `out` as it streams.
    `client`: more `Client` arguments (TLS, `api_key`)."""
    parts: list[str] = []
    num_tokens = 0
    finish_reason: str | None = None
    messages = [{"role": "user", "content": prompt}]
    with Client(address, timeout=timeout, **client) as connection:
        stream = connection.generate(
            messages=messages, max_tokens=max_tokens, temperature=temperature
        )
        for delta in stream:
            parts.append(delta.text)
            num_tokens += len(delta.token_ids)
            if out is not None and delta.text:
                out.write(delta.text)
                out.flush()
            finish_reason = delta.finish_reason or finish_reason
    return ChatAnswer("".join(parts), num_tokens, finish_reason or "unspecified")
