"""A public request's sampling parameters as the tokenizer service uses them, and the engine
request's built straight from them: one conversion on this hop, no engine objects.

    GenerateRequest.sampling_params ─┬─▶ over the model's generation-config defaults (proto)
                                     ├─▶ RequestSampling: read with vLLM's defaults for what
                                     │   is still unset (n, stop strings, skip_special_tokens,
                                     │   ... for the text streams, beam search and the span)
                                     └─▶ engine_proto(): what the engine gets (stop strings
                                         stay here; bad_words go as token ids)

Nothing here validates a value: the engine checks every token and sampling parameter (it is
also reached directly, over vLLM's protocol), and its INVALID_ARGUMENT, which names the field
by its proto path, reaches the client unchanged. What needs text or the tokenizer (stop strings
are matched here, bad words are tokenized here) and what a request may cost
(request_limits.py) are checked on this side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.api.bad_words import bad_words_token_ids
from engine.api.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2

_FIELDS = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
# vLLM's defaults, read off the engine's own dataclass (torch-free) so they cannot drift.
_VLLM_DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(SamplingParams)
    if f.default is not dataclasses.MISSING
}


class RequestSampling:
    """The caller's fields over the model's defaults (`msg`), read with vLLM's defaults for
    what is still unset: `sampling.n`, `sampling.stop`, `sampling.skip_special_tokens`, ..."""

    def __init__(self, requested: common_pb2.SamplingParams, defaults: Mapping[str, Any]) -> None:
        msg = common_pb2.SamplingParams()
        msg.CopyFrom(requested)
        for name, value in defaults.items():
            field = _FIELDS.get(name)
            if field is None or not field.has_presence or msg.HasField(name):
                continue
            try:
                setattr(msg, name, value)
            except (TypeError, ValueError):
                continue  # a generation-config value the wire cannot hold: vLLM's default
        self.msg = msg

    def __getattr__(self, name: str) -> Any:
        field = _FIELDS.get(name)
        if field is None:
            raise AttributeError(name)
        value = getattr(self.msg, name)
        if field.is_repeated:
            return list(value)
        if field.has_presence and not self.msg.HasField(name):
            return _VLLM_DEFAULTS.get(name)
        return value

    def engine_proto(self, tokenizer: Any) -> common_pb2.SamplingParams:
        """The engine request's sampling parameters: every field as merged, without the stop
        strings (matched here, on text) and with `bad_words` as token ids (the engine has no
        tokenizer on this path)."""
        msg = common_pb2.SamplingParams()
        msg.CopyFrom(self.msg)
        msg.ClearField("stop")
        if msg.bad_words:
            for ids in bad_words_token_ids(tokenizer, list(msg.bad_words)):
                msg.bad_words_token_ids.add(ids=ids)
            msg.ClearField("bad_words")
        return msg
