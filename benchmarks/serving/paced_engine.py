"""A paced engine stand-in: the real engine service's gRPC server with an engine that makes
tokens at a GPU's rate and costs (almost) nothing, so the tokenizer service in front of it
can be measured at the token rate one GPU produces, which no CPU engine reaches.

    python benchmarks/serving/paced_engine.py --port 50052 --step-ms 5 --token-ids-file ids.json

What is real: `services.engine_service.server.EngineServer` (its `EngineServicer`, the
multiplexed GenerateStream with its batch writer, Health, GetModelInfo, the standard health
service, the wire guard), and each request's path through the servicer (the checks, the
SERVER span, admission, `convert.EngineResponseBuilder` building every entry into the
step's batch through `generate_into`'s callback), i.e. exactly what the tokenizer service
talks to. What stands in: `PacedEngine`, in place of `AsyncLLMEngine`. Every step period it
gives each live request (each of its n outputs) one token, taken from real English text
encoded with the default model's tokenizer (`played_ids`), so the tokenizer service's
detokenization does realistic work. It honours `max_tokens` (finish "length", with the
usage the real engine reports), a resumed request's tokens so far, `logprobs` (the chosen
token only, logprob -1), and cancellation (the caller's abort).

The steps run on the server's event loop at a fixed period (absolute deadlines; a step
that comes late is not made up for: like an engine whose host fell behind, it just runs
later). The real engine steps on its own thread and hands each step's outputs to the loop
in one callback; here the loop calls the same callbacks itself, once per step. A burst's
first step waits until `--batch-size` requests are live (at most 10 s), so a benchmark's
burst runs at its full rate from the start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

VOCAB_SIZE = 49152  # the default model's tokenizer
EOS_TOKEN_ID = 2
MAX_MODEL_LEN = 32768
_CHOSEN_LOGPROB = -1.0
_TEXT_CHARS = 200_000  # of the English text the tokens are taken from


def english_text() -> str:
    """The text the stand-in plays: the project's own documentation pages (English prose
    with tables, code and some non-ASCII characters), in name order."""
    pages = sorted((ROOT / "docs").glob("*.md"))
    return "\n\n".join(p.read_text(encoding="utf-8") for p in pages)[:_TEXT_CHARS]


def encode_english_text(tokenizer: Any) -> list[int]:
    """`english_text()` as token ids of `tokenizer` (the default model's), special tokens
    left out so the stand-in never plays an end-of-sequence token."""
    ids = tokenizer.encode(english_text(), add_special_tokens=False)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ()) | {EOS_TOKEN_ID}
    return [i for i in ids if i not in special]


def start_offset(prompt_token_ids: list[int], index: int, num_ids: int) -> int:
    """Where in the played ids output `index` of a request with this prompt starts: a
    function of the prompt alone, so a client knows which text it should get back."""
    digest = zlib.crc32(array("I", prompt_token_ids).tobytes())
    return (digest + 7919 * index) % num_ids


def played_ids(
    ids: list[int], prompt_token_ids: list[int], index: int, start: int, count: int
) -> list[int]:
    """The `count` token ids output `index` gets from its `start`-th token on."""
    offset = start_offset(prompt_token_ids, index, len(ids)) + start
    return [ids[(offset + j) % len(ids)] for j in range(count)]


@dataclass
class _Output:
    index: int
    position: int  # next index into the played ids
    num_tokens: int  # made so far (resumed ones included)


@dataclass
class _Live:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    logprobs: bool
    on_output: Any
    done: asyncio.Future[None]
    outputs: list[_Output] = field(default_factory=list)


@dataclass(frozen=True)
class _Stats:
    """What the servicer's Health reads (`engine.front.engine_commands.EngineStats`)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 1 << 20
    num_total_blocks: int = 1 << 20
    kv_cache_usage: float = 0.0
    num_requests: int = 0
    num_preemptions_total: int = 0
    is_sleeping: bool = False


@dataclass(frozen=True)
class _Parallel:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


class PacedEngine:
    """The part of `AsyncLLMEngine` the servicer's GenerateStream and Health use, making one
    token per live output every `step_s` seconds (module docstring)."""

    errored = False

    def __init__(
        self, ids: list[int], step_s: float, batch_size: int = 1, fill_timeout_s: float = 10.0
    ) -> None:
        from engine import CompletionOutput, Logprob, RequestOutput

        self._classes = (CompletionOutput, Logprob, RequestOutput)
        self.ids = ids
        self.step_s = step_s
        self.batch_size = batch_size
        self.fill_timeout_s = fill_timeout_s
        self._filled = asyncio.Event()
        self.engine = self  # `engine.engine.get_parallel_config()` in Health
        self._live: dict[str, _Live] = {}
        self._stepping: asyncio.Task[None] | None = None
        self.num_steps = 0
        self.num_late_steps = 0  # began more than a period after their deadline
        self.max_live = 0  # the most requests live at once

    def get_parallel_config(self) -> _Parallel:
        return _Parallel()

    async def check_health(self) -> None:
        return None

    def get_stats(self) -> _Stats:
        return _Stats(num_running=len(self._live), num_requests=len(self._live))

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            live = self._live.pop(request_id, None)
            if live is not None and not live.done.done():
                live.done.cancel()

    async def generate_into(
        self,
        prompt: dict[str, Any],
        sampling_params: Any,
        request_id: str,
        on_output: Any,
        resumed_output_token_ids: dict[int, list[int]] | None = None,
        **_: Any,
    ) -> None:
        """One request, its outputs handed to `on_output` once per step until each has
        `max_tokens`. Cancelled: the request is dropped (the caller's abort)."""
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request.")
        prompt_ids = list(prompt["prompt_token_ids"])
        max_tokens = sampling_params.max_tokens or MAX_MODEL_LEN - len(prompt_ids)
        live = _Live(
            request_id,
            prompt_ids,
            max_tokens,
            bool(sampling_params.logprobs),
            on_output,
            asyncio.get_running_loop().create_future(),
        )
        resumed = resumed_output_token_ids
        indexes = sorted(resumed) if resumed else range(sampling_params.n)
        for index in indexes:
            made = len(resumed[index]) if resumed else 0
            start = start_offset(prompt_ids, index, len(self.ids)) + made
            live.outputs.append(_Output(index, start, made))
        self._live[request_id] = live
        self.max_live = max(self.max_live, len(self._live))
        if len(self._live) >= self.batch_size:
            self._filled.set()
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.ensure_future(self._step_loop())
        try:
            await live.done
        finally:
            self._live.pop(request_id, None)

    async def _step_loop(self) -> None:
        """Steps while any request is live. The first step waits for `batch_size` live
        requests (or `fill_timeout_s`): a burst is measured at its full rate, not while the
        tokenizer service is still taking its calls in (grpc.aio takes one new call per
        turn of its event loop)."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._filled.wait(), self.fill_timeout_s)
        self._filled.clear()
        deadline = loop.time()
        while self._live:
            deadline += self.step_s
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                if -delay > self.step_s:
                    self.num_late_steps += 1
                deadline = loop.time()  # late: no catching up
            self._step()
        self._filled.clear()  # the next burst waits for its own batch

    def _step(self) -> None:
        """One token for every live output, each request's output handed over."""
        completion_class, logprob_class, request_class = self._classes
        ids, num_ids = self.ids, len(self.ids)
        self.num_steps += 1
        for live in list(self._live.values()):
            if live.done.done():
                continue
            completions = []
            finished = True
            for out in live.outputs:
                token = ids[out.position % num_ids]
                out.position += 1
                out.num_tokens += 1
                last = out.num_tokens >= live.max_tokens
                finished = finished and last
                logprobs = None
                if live.logprobs:
                    logprobs = [{token: logprob_class(_CHOSEN_LOGPROB, rank=1)}]
                completions.append(
                    completion_class(
                        index=out.index,
                        text="",
                        token_ids=[token],
                        cumulative_logprob=None,
                        logprobs=logprobs,
                        finish_reason="length" if last else None,
                    )
                )
            live.outputs = [o for o in live.outputs if o.num_tokens < live.max_tokens]
            output = request_class(
                request_id=live.request_id,
                prompt=None,
                prompt_token_ids=live.prompt_token_ids,
                prompt_logprobs=None,
                outputs=completions,
                finished=finished,
                num_cached_tokens=0,
            )
            try:
                live.on_output(output)
            except Exception as exc:  # as the real engine: the request fails, others go on
                live.done.set_exception(exc)
                continue
            if finished:
                live.done.set_result(None)


async def serve(port: int, ids: list[int], step_s: float, batch_size: int = 1) -> None:
    """The real engine server on `127.0.0.1:port` with a `PacedEngine` attached."""
    from pagedserve.v1 import common_pb2
    from services.engine_service.server import EngineServer, EngineServerConfig

    config = EngineServerConfig(
        address=f"127.0.0.1:{port}", engine_stall_timeout_s=0, log_stats_interval_s=0
    )
    server = EngineServer(config)
    await server.start()
    paced = PacedEngine(ids, step_s, batch_size)
    # What `EngineServer.attach_engine` does, from fixed facts instead of an EngineConfig.
    server.servicer.model_info = common_pb2.ModelInfo(
        model="paced-engine",
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB_SIZE,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=[EOS_TOKEN_ID],
        dtype="bfloat16",
        device="paced",
        block_size=16,
        num_kv_blocks=1 << 20,
        hidden_size=64,
        effective_max_model_len=MAX_MODEL_LEN,
        max_logprobs=20,
    )
    server.servicer.model_name = "paced-engine"
    server.servicer.engine = paced  # type: ignore[assignment]
    await server.health.set_serving(True, "paced engine ready")
    try:
        await server.wait_for_termination()
    finally:
        print(
            json.dumps(
                {
                    "steps": paced.num_steps,
                    "late_steps": paced.num_late_steps,
                    "max_live": paced.max_live,
                }
            ),
            file=sys.stderr,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, required=True, help="the step period")
    parser.add_argument(
        "--token-ids-file", type=Path, required=True, help="JSON list of the played token ids"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="live requests the first step of a burst waits for (at most 10 s; 1)",
    )
    args = parser.parse_args()
    if args.step_ms <= 0:
        parser.error(f"--step-ms must be > 0, got {args.step_ms}")
    ids = json.loads(args.token_ids_file.read_text())
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if not ids:
        parser.error("--token-ids-file holds no token ids")
    logging.basicConfig(level=logging.WARNING)
    import signal

    loop = asyncio.new_event_loop()
    task = loop.create_task(serve(args.port, ids, args.step_ms / 1000.0, args.batch_size))
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(task)
    return 0


if __name__ == "__main__":
    sys.exit(main())
