"""One request's stream on the tokenizer service: token-id deltas in, text deltas out.

Each of the n outputs has its own incremental detokenizer (`engine.api.detokenizer`; stepped in
Rust by `engine.api.stream_detokenizer` where the tokenizer has a Rust backend), which never
emits half a UTF-8 character, applies the stop strings and holds back a tail that could
still become one. Tokens are fed one at a time when there are stop strings, so an output
ends on exactly the token that completed its stop string (as offline `LLM.generate` does).

A stream outlives the engine replica that produced it: when the request moves to another
replica (services/tokenizer_service/replicas/migration.py), that replica sends only the new
tokens of each output, with their original index, and this stream carries on with the same
detokenizers and stop-string state, so no text is sent twice or lost. Each output keeps
its token ids (`resume_points`, what the next replica continues from).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.api.detokenizer import IncrementalDetokenizer
from engine.api.stream_detokenizer import make_detokenizer
from pagedserve.v1 import common_pb2, engine_pb2, generation_pb2
from services.common.finish_reasons import FINISH_REASON_NAMES
from services.tokenizer_service.sampling import RequestSampling


class TokenTexts:
    """Each token decoded alone, for logprob entries (memoised: the vocabulary is finite)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def fill(self, positions: Iterable[common_pb2.PositionLogprobs]) -> None:
        for position in positions:
            if position.HasField("chosen"):
                position.chosen.text = self(position.chosen.token_id)
            for entry in position.top:
                entry.text = self(entry.token_id)


@dataclass
class _Output:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # every token of this output so far
    cumulative_logprob: float = 0.0  # the last value sent
    logprob_base: float = 0.0  # what earlier replicas summed: a new one starts from zero
    num_tokens: int = 0
    num_sent_chars: int = 0
    finished: bool = False
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED


class TextStream:
    def __init__(
        self,
        request_id: str,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: RequestSampling,
        token_texts: TokenTexts,
    ) -> None:
        self.request_id = request_id
        self.token_texts = token_texts
        self.num_prompt_tokens = len(prompt_token_ids)
        self.outputs = [
            _Output(
                make_detokenizer(
                    tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=list(params.stop or []),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            )
            for _ in range(params.n)
        ]
        self.started = False  # any engine message came back (a move now resumes outputs)
        self._num_open = len(self.outputs)  # outputs not finished
        # Whether logprobs can come: the engine sends them (and the cumulative logprob) only
        # when asked, so a request without them never looks for them.
        self._logprobs = params.logprobs is not None or params.prompt_logprobs is not None

    @property
    def finished(self) -> bool:
        """Every output has ended. A stream with none (n = 0) has not: that request is the
        engine's to refuse, and the relay must still ask it."""
        return self._num_open == 0 and bool(self.outputs)

    @property
    def finish_reasons(self) -> list[str]:
        """Per output index: "stop", "length", "abort" ("" while it is open)."""
        return [FINISH_REASON_NAMES.get(out.finish_reason, "") for out in self.outputs]

    @property
    def num_tokens(self) -> int:
        return sum(out.num_tokens for out in self.outputs)

    @property
    def num_sent_chars(self) -> int:
        return sum(out.num_sent_chars for out in self.outputs)

    def process(
        self, msg: engine_pb2.EngineGenerateResponse
    ) -> generation_pb2.GenerateResponse | None:
        """The client's message for one engine message (`process_messages` of one)."""
        return self.process_messages((msg,), msg.token_ids[:])

    def process_messages(
        self, messages: Sequence[engine_pb2.EngineGenerateResponse], token_ids: list[int]
    ) -> generation_pb2.GenerateResponse | None:
        """The client's message for consecutive engine messages of one output (what waited
        in the relay's reader), as for the one message they merge into
        (`merge_engine_messages`); None once that output has ended (a stop string ended it
        here while the engine was still generating). `token_ids`: the messages' token ids
        concatenated (the relay's reader has read them; not kept).

        Runs once per client message: the detokenizer is fed the token ids in one call;
        each field is read once (the finish, stop reason, usage and cumulative logprob from
        the last message that has them, as a merge keeps the later one's) and only what
        differs from the default is set (cheap checks first: stop strings, logprobs and
        prompt logprobs are looked at only where the request has them)."""
        self.started = True
        last = messages[-1]
        index = last.index
        out = self.outputs[index]
        if out.finished:
            return None
        detokenizer = out.detokenizer
        stop = None
        if detokenizer.stop:
            for i, token_id in enumerate(token_ids):
                stop = detokenizer.update([token_id])
                if stop is not None:
                    token_ids = token_ids[: i + 1]
                    break
        else:
            detokenizer.update(token_ids)
        num_kept = len(token_ids)
        out.num_tokens += num_kept
        out.token_ids += token_ids
        response = generation_pb2.GenerateResponse(request_id=self.request_id, token_ids=token_ids)
        if index:
            response.index = index
        msg_usage = last.usage
        usage = response.usage
        usage.prompt_tokens = msg_usage.prompt_tokens
        usage.completion_tokens = out.num_tokens
        if msg_usage.cached_tokens:
            usage.cached_tokens = msg_usage.cached_tokens
        if self._logprobs:
            self._add_logprobs(messages, response, out, num_kept)
        finish_reason = last.finish_reason
        if stop is not None:
            finish_reason = response.finish_reason = common_pb2.FINISH_REASON_STOP
            response.stop_reason.text = stop
        elif finish_reason:
            response.finish_reason = finish_reason
            stop_reason = _last_with(messages, "stop_reason")
            if stop_reason is not None:
                response.stop_reason.CopyFrom(stop_reason.stop_reason)
        if finish_reason:
            out.finish_reason = finish_reason
            out.finished = True
            self._num_open -= 1
        text = self._new_text(out)
        if text:
            response.text = text
        return response

    def _add_logprobs(
        self,
        messages: Sequence[engine_pb2.EngineGenerateResponse],
        response: generation_pb2.GenerateResponse,
        out: _Output,
        num_kept: int,
    ) -> None:
        """Logprobs (the first `num_kept` tokens'), prompt logprobs and the cumulative
        logprob, with each token's text."""
        logprobs = [p for msg in messages for p in msg.logprobs]
        if logprobs:
            response.logprobs.extend(logprobs[:num_kept])
            self.token_texts.fill(response.logprobs)
        for msg in messages:
            if msg.prompt_logprobs:
                response.prompt_logprobs.extend(msg.prompt_logprobs)
        if response.prompt_logprobs:
            self.token_texts.fill(response.prompt_logprobs)
        last = _last_with(messages, "cumulative_logprob")
        if last is not None:
            dropped = logprobs[num_kept:]
            response.cumulative_logprob = (
                out.logprob_base + last.cumulative_logprob - sum(p.chosen.logprob for p in dropped)
            )
            out.cumulative_logprob = response.cumulative_logprob

    def resume_points(self) -> dict[int, list[int]]:
        """For a move to another replica: each unfinished output's tokens so far. The new
        replica's `cumulative_logprob` covers its own tokens only, so it is added to what
        each output had."""
        points: dict[int, list[int]] = {}
        for index, out in enumerate(self.outputs):
            if not out.finished:
                out.logprob_base = out.cumulative_logprob
                points[index] = list(out.token_ids)
        return points

    def abort_unfinished(self) -> list[generation_pb2.GenerateResponse]:
        """Last messages (finish_reason ABORT) for the outputs that have not ended."""
        responses = []
        for index, out in enumerate(self.outputs):
            if out.finished:
                continue
            out.finished = True
            out.finish_reason = common_pb2.FINISH_REASON_ABORT
            self._num_open -= 1
            responses.append(
                generation_pb2.GenerateResponse(
                    request_id=self.request_id,
                    index=index,
                    text=self._new_text(out),
                    finish_reason=common_pb2.FINISH_REASON_ABORT,
                    usage=common_pb2.Usage(
                        prompt_tokens=self.num_prompt_tokens, completion_tokens=out.num_tokens
                    ),
                )
            )
        return responses

    @staticmethod
    def _new_text(out: _Output) -> str:
        text = out.detokenizer.get_text(out.finished)[out.num_sent_chars :]
        out.num_sent_chars += len(text)
        return text


def _last_with(
    messages: Sequence[engine_pb2.EngineGenerateResponse], name: str
) -> engine_pb2.EngineGenerateResponse | None:
    """The last of `messages` with the field `name` set (a merge keeps the later one's)."""
    for msg in reversed(messages):
        if msg.HasField(name):
            return msg
    return None
