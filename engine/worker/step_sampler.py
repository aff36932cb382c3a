"""Logits and what is made of them in a step: sampling, draft verification, prompt
logprobs, and (on a TP rank other than 0) joining the sampling rank's logits gathers.

Split out of the model runner (engine/worker/model_runner.py), which owns the model, the
sampler and the device; a `StepSampler` reads them from the runner at each call, so a
model reloaded after sleep mode is the one used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.api.sampling_params import SamplingType
from engine.core.sched_output import LogprobsLists, ModelRunnerOutput, ScheduledRequest
from engine.sample import SamplingMetadata, SamplingRow, gather_logprobs
from engine.sample.metadata import add_row_features
from engine.sample.sampling_slots import SamplingSlots
from engine.sample.token_controls import apply_grammar_bitmask_
from engine.worker.host_reads import StepReads, to_host
from engine.worker.inputs import StepInputs


class StepSampler:
    def __init__(self, runner: Any) -> None:
        self.runner = runner  # engine.worker.model_runner.ModelRunner
        # Per request, whether its parameters ask for nothing but the argmax: decided once
        # when it joins (the parameters never change), dropped when it leaves (persistent
        # per-request state, as vLLM's persistent batch keeps).
        self._argmax_only_params: dict[str, tuple[Any, bool]] = {}
        # The last `sample` call's ids on the device, per group of entries (reset by the
        # runner each step): the inputs of the next step's placeholder rows.
        self.device_sampled: list[tuple[list[ScheduledRequest], torch.Tensor]] = []
        # The sampler's per-request parameters, kept on the device across steps; made at
        # the first sampling step, when the runner's uploads (pinned or not) exist.
        self.slots: SamplingSlots | None = None

    def drop(self, request_ids: set[str]) -> None:
        """Forgets the per-request state of requests that finished or were preempted."""
        for request_id in request_ids:
            self._argmax_only_params.pop(request_id, None)
        if self.slots is not None:
            self.slots.drop(request_ids)

    def _metadata(self, entries: list[ScheduledRequest], vocab_size: int) -> SamplingMetadata:
        """The rows' sampling tensors: the parameters gathered from their slots, then what
        is built from their tokens and lists each step, only where some row needs it."""
        if self.slots is None:
            self.slots = SamplingSlots(self.runner.device, getattr(self.runner.upload, "pin", None))
        metadata, needs_rows = self.slots.metadata(
            [
                (
                    r.request_id,
                    r.sampling_params,
                    r.seed,
                    r.num_output_tokens + e.num_placeholder_inputs,
                    r.prompt_token_ids,
                    r.output_token_ids,
                )
                for e in entries
                for r in (e.request,)
            ],
            vocab_size,
        )
        if needs_rows or any(e.request.structured_output is not None for e in entries):
            rows = [sampling_row(e) for e in entries]
            add_row_features(metadata, rows, self.runner.device)
        return metadata

    def _argmax_only_rows(self, batch: list[ScheduledRequest], rows: list[int]) -> list[int]:
        """The positions in `rows` whose request wants only the argmax (`wants_argmax_only`),
        with the parameters' part looked up once per request: a request whose parameters
        qualify and ask no `min_tokens` needs only its grammar looked at per step."""
        cache = self._argmax_only_params
        plain: list[int] = []
        for j, i in enumerate(rows):
            request = batch[i].request
            params = request.sampling_params
            cached = cache.get(request.request_id)
            if cached is None or cached[0] is not params:
                cached = (params, _params_want_argmax_only(params))
                cache[request.request_id] = cached
            if (
                cached[1]
                and (not params.min_tokens or len(request.output_token_ids) >= params.min_tokens)
                and (request.structured_output is None or _matcher(request) is None)
            ):
                plain.append(j)
        return plain

    def sample(
        self,
        batch: list[ScheduledRequest],
        rows: list[int],
        inputs: StepInputs,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
        copy: Any = None,
    ) -> Callable[[], None]:
        """Samples the rows' next tokens; the ids (and logprobs) of every row come to the
        host in one copy (engine/worker/host_reads.py), started here with `copy` (an
        `async_output.HostCopy`; None: read now). Returns what fills `output` once the
        copy is done (engine/worker/async_output.py). The sampled ids stay on the device
        in `device_sampled` for the next step's placeholder rows."""
        index = self._last_token_index(rows, inputs)
        reads = StepReads()
        screened, rows, index = self._screen_argmax_rows(batch, rows, index, hidden, reads)
        entries = [batch[i] for i in rows]
        sampled = logprobs = None
        if rows:
            logits = self.runner.model.compute_logits(hidden[index])  # [num_rows, vocab] fp32
            metadata = self._metadata(entries, logits.shape[-1])
            result = self.runner.sampler(logits, metadata)
            self.slots.advance(result.sampled_token_ids)  # type: ignore[union-attr]
            self.device_sampled.append((entries, result.sampled_token_ids))
            sampled = reads.add(result.sampled_token_ids)
            if result.logprobs is not None:
                lp = result.logprobs
                logprobs = (reads.add(lp.token_ids), reads.add(lp.logprobs), reads.add(lp.ranks))
        pending = reads.start(copy)  # the step's one device-to-host copy

        def finish() -> None:
            host = pending.wait()
            if screened is not None:
                screened_entries, slot = screened
                output.sampled_token_ids.update(
                    zip([e.request.request_id for e in screened_entries], host[slot])
                )
            if sampled is None:
                return
            output.sampled_token_ids.update(
                zip([e.request.request_id for e in entries], host[sampled])
            )
            if logprobs is None:
                return
            token_ids, values, ranks = (host[j] for j in logprobs)
            for row, entry in enumerate(entries):
                k = entry.request.sampling_params.logprobs  # type: ignore[union-attr]
                if k is not None:
                    output.logprobs[entry.request_id] = LogprobsLists(
                        [token_ids[row][: k + 1]], [values[row][: k + 1]], [ranks[row]]
                    )

        return finish

    def _screen_argmax_rows(
        self,
        batch: list[ScheduledRequest],
        rows: list[int],
        index: torch.Tensor,  # [len(rows)]: each row's hidden state
        hidden: torch.Tensor,
        reads: StepReads,
    ) -> tuple[tuple[list[ScheduledRequest], int] | None, list[int], torch.Tensor]:
        """Samples the rows that want only the argmax through the model's greedy screen,
        skipping the fp32 LM head (models/greedy_screen.py): their entries and the slot of
        their ids in `reads` (None when no row took the screen), then the other rows and
        their index, for the logits and the sampler."""
        model = self.runner.model
        if getattr(model, "greedy_screen", None) is None:
            return None, rows, index
        plain = self._argmax_only_rows(batch, rows)
        if not plain:
            return None, rows, index
        every_row = len(plain) == len(rows)
        if every_row and len(rows) == hidden.shape[0]:  # one token per row: index = 0..n-1
            screen_hidden = hidden
        else:
            screen_hidden = hidden[index if every_row else index[plain]]
        tokens = model.greedy_argmax(screen_hidden)
        if tokens is None:
            return None, rows, index
        screened = ([batch[rows[j]] for j in plain], reads.add(tokens))
        self.device_sampled.append((screened[0], tokens))
        if every_row:
            return screened, [], index[:0]
        rest = sorted(set(range(len(rows))) - set(plain))
        return screened, [rows[j] for j in rest], index[rest]

    def verify_drafts(
        self,
        batch: list[ScheduledRequest],
        rows: list[int],
        inputs: StepInputs,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Greedy verification of k drafts from the logits at the k + 1 positions::

            input     t  d0 d1 d2        (last known token, then the drafts)
            argmax    a0 a1 a2 a3        a_i: the greedy token after input position i
            accepted  d0 d1 while d_i == a_i; output = accepted drafts + the next a_i

        So the output is exactly what greedy decoding one token at a time produces. Without
        grammar masks the argmaxes come from the model's greedy screen where it has one
        (engine/layers/greedy_screen.py), as plain greedy rows' tokens do.
        """
        index = self._draft_index(rows, inputs)
        model = self.runner.model
        tokens = None
        if all(_matcher(batch[i].request) is None for i in rows):  # no grammar masks
            greedy_argmax = getattr(model, "greedy_argmax", None)
            tokens = None if greedy_argmax is None else greedy_argmax(hidden[index])
        if tokens is None:
            logits = model.compute_logits(hidden[index])  # [sum(k + 1), vocab] fp32
            tokens = _mask_drafts(logits, [batch[i] for i in rows]).argmax(dim=-1)
        argmax = to_host(tokens)
        offset = 0
        for i in rows:
            entry = batch[i]
            drafts = entry.spec_token_ids
            greedy = argmax[offset : offset + len(drafts) + 1]
            offset += len(drafts) + 1
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == greedy[num_accepted]:
                num_accepted += 1
            output.spec_output_token_ids[entry.request_id] = greedy[: num_accepted + 1]

    # ---- which hidden rows get logits (the sampling rank and its TP peers agree) ----------

    def _last_token_index(self, rows: list[int], inputs: StepInputs) -> torch.Tensor:
        return self.runner.upload(
            [inputs.query_start_loc_cpu[i + 1] - 1 for i in rows], torch.int64
        )

    def _draft_index(self, rows: list[int], inputs: StepInputs) -> torch.Tensor:
        positions: list[int] = []
        for i in rows:
            first = inputs.query_start_loc_cpu[i]
            positions.extend(range(first, inputs.query_start_loc_cpu[i + 1]))
        return torch.tensor(positions, device=self.runner.device)

    @staticmethod
    def _prompt_logprob_rows(entry: ScheduledRequest, inputs: StepInputs, row: int) -> slice:
        start = entry.num_computed_tokens
        end = min(start + entry.num_new_tokens, entry.request.num_prompt_tokens - 1)
        first = inputs.query_start_loc_cpu[row]
        return slice(first, first + end - start)

    def follow_logits(
        self,
        batch: list[ScheduledRequest],
        sampling: list[int],
        speculative: list[int],
        prompt_lp: list[int],
        inputs: StepInputs,
        hidden: torch.Tensor,
    ) -> None:
        """A TP rank other than 0 joins each logits gather of the sampling rank (one per
        `compute_logits` call there), in the same order and with the same row counts."""
        if sampling:
            self.runner.model.compute_logits(hidden[self._last_token_index(sampling, inputs)])
        if speculative:
            self.runner.model.compute_logits(hidden[self._draft_index(speculative, inputs)])
        for i in prompt_lp:
            self.runner.model.compute_logits(hidden[self._prompt_logprob_rows(batch[i], inputs, i)])

    @staticmethod
    def wants_prompt_logprobs(entry: ScheduledRequest) -> bool:
        # Positions whose logits predict a *prompt* token: p with p + 1 < num_prompt_tokens.
        params = entry.request.sampling_params
        return (
            params is not None
            and params.prompt_logprobs is not None
            and entry.num_computed_tokens + 1 < entry.request.num_prompt_tokens
        )

    def prompt_logprobs(
        self,
        entry: ScheduledRequest,
        inputs: StepInputs,
        row: int,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        request = entry.request
        start = entry.num_computed_tokens
        end = min(start + entry.num_new_tokens, request.num_prompt_tokens - 1)
        logits = self.runner.model.compute_logits(
            hidden[self._prompt_logprob_rows(entry, inputs, row)]
        )
        logprobs = torch.log_softmax(logits, dim=-1)  # [end - start, vocab]
        targets = torch.tensor(
            request.prompt_token_ids[start + 1 : end + 1], device=self.runner.device
        )
        assert request.sampling_params is not None
        k = request.sampling_params.prompt_logprobs
        assert k is not None
        tensors = gather_logprobs(logprobs, targets, k)
        reads = StepReads()
        for part in (tensors.token_ids, tensors.logprobs, tensors.ranks):
            reads.add(part)
        output.prompt_logprobs[request.request_id] = (start + 1, LogprobsLists(*reads.read()))


def sampling_row(entry: ScheduledRequest) -> SamplingRow:
    """The sampler's view of one scheduled entry: its parameters and tokens so far."""
    request = entry.request
    return SamplingRow(
        params=request.sampling_params,  # type: ignore[arg-type]
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        seed=request.seed,
        num_output_placeholders=entry.num_placeholder_inputs,
        grammar=_matcher(request),
    )


def wants_argmax_only(request: Any) -> bool:
    """Whether the request's next token is the plain argmax of its logits: greedy, and none
    of the sampler's features that read or change the logits (logprobs, penalties, bias,
    allowed or bad words, logits processors, a grammar, min_tokens still banning stops)."""
    params = request.sampling_params
    return (
        _params_want_argmax_only(params)
        and len(request.output_token_ids) >= params.min_tokens
        and _matcher(request) is None
    )


def _params_want_argmax_only(params: Any) -> bool:
    """The part of `wants_argmax_only` that depends on the parameters alone."""
    return (
        params.sampling_type == SamplingType.GREEDY
        and params.logprobs is None
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and not params.logits_processors
    )


def _matcher(request: Any) -> Any:
    """The request's grammar matcher under structured outputs, else None."""
    state = request.structured_output
    return None if state is None else state.matcher


def _mask_drafts(logits: torch.Tensor, entries: list[ScheduledRequest]) -> torch.Tensor:
    """Grammar masks for the k + 1 verification positions of constrained requests.

    The mask at position i is the grammar's after drafts d0..d(i-1): the matcher walks the
    drafts (stopping at the first it refuses, which the masked argmax then rejects too)
    and rolls back, so verification picks exactly the tokens constrained greedy decoding
    would. logits: [sum(k + 1), V].
    """
    constrained = [(e, _matcher(e.request)) for e in entries]
    num_positions = sum(len(e.spec_token_ids) + 1 for e, m in constrained if m is not None)
    if not num_positions:
        return logits
    # Only the constrained requests' positions get a mask row, applied in place.
    bitmask = torch.full((num_positions, -(-logits.shape[1] // 32)), -1, dtype=torch.int32)
    row_ids: list[int] = []
    offset = 0
    for entry, matcher in constrained:
        drafts = entry.spec_token_ids
        if matcher is not None:
            num_walked = 0
            for i in range(len(drafts) + 1):
                matcher.fill_bitmask(bitmask, len(row_ids) + i)
                if i == len(drafts) or not matcher.accept_token(drafts[i]):
                    break
                num_walked += 1
            matcher.rollback(num_walked)
            row_ids.extend(range(offset, offset + len(drafts) + 1))
        offset += len(drafts) + 1
    rows = torch.tensor(row_ids, dtype=torch.int64, device=logits.device)
    return apply_grammar_bitmask_(logits, bitmask, rows)
