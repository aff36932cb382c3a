"""`LLM`: offline batched generation (vLLM's class of the same name)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from engine.api.beam_search import BeamSearchInstance, BeamSearchOutput
from engine.api.outputs import PoolingRequestOutput, RequestOutput
from engine.api.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    generation_config_defaults,
)
from engine.config.engine_config import EngineArgs
from engine.config.step_budget import OFFLINE_MAX_NUM_BATCHED_TOKENS
from engine.front.llm_engine import LLMEngine, PromptType
from engine.pooling_params import PoolingParams

ChatMessage = dict[str, Any]


class LLM:
    """Generates for a batch of prompts at once.

    >>> llm = LLM()  # the default model
    >>> outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=8))
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("disable_log_stats", True)
        if kwargs.get("enable_chunked_prefill", True):
            # Offline: throughput over step latency (engine/config/step_budget.py).
            kwargs.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the model's generation config where it sets them."""
        gen = self.llm_engine.get_model_config().generation_config
        return SamplingParams(**generation_config_defaults(gen))

    def start_profile(self) -> None:
        """Profiles the following `generate` calls (`LLMEngine.start_profile`)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> Path:
        """Writes the Chrome trace under `PAGEDSERVE_TORCH_PROFILER_DIR`; returns its path."""
        return self.llm_engine.stop_profile()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Gives the KV cache (level 1) or the cache and the weights (level 2) back until
        `wake_up()` (`LLMEngine.sleep`)."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm_engine.wake_up(tags)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _per_prompt(sampling_params, SamplingParams, len(prompts), "sampling_params")
        for i, params in enumerate(params_list):
            params_list[i] = params = params.clone()
            params.output_kind = RequestOutputKind.FINAL_ONLY
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts.")
        request_ids = self._add_requests(prompts, params_list, lora_request, priority)
        return self._run_engine(request_ids, use_tqdm)  # type: ignore[return-value]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """Pools each prompt's final hidden states as the engine's `pooler_config` says
        (LAST token by default, MEAN or CLS), cut to `dimensions` and L2-normalised where
        the params ask; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params_list = _per_prompt(pooling_params, PoolingParams, len(prompts), "pooling_params")
        request_ids = self._add_requests(prompts, params_list, lora_request, None)
        return self._run_engine(request_ids, use_tqdm)  # type: ignore[return-value]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search of every prompt at once (see engine/api/beam_search.py): each step
        runs
        all live beams of all prompts as one batch of one-token requests; the prefix cache
        shares their common blocks. Returns one `BeamSearchOutput` per prompt, in order."""
        if lora_request is not None:
            raise NotImplementedError("lora_request: LoRA adapters are not supported yet.")
        tokenizer = self.llm_engine.tokenizer
        eos_ids = self.llm_engine.get_model_config().eos_token_ids
        instances = [
            BeamSearchInstance(self._prompt_token_ids(p), params, eos_ids)
            for p in _as_prompt_list(prompts)
        ]
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm)
        with bar:
            while live := [inst for inst in instances if not inst.done]:
                self._beam_search_step(live)
                bar.update(1)
        outputs = [inst.output() for inst in instances]
        for inst, output in zip(instances, outputs):
            for beam in output.sequences:
                generated = beam.tokens[inst.num_prompt_tokens :]
                if generated and beam.finish_reason == "stop" and not params.ignore_eos:
                    generated = generated[:-1]  # the EOS is not part of the text (as vLLM)
                beam.text = tokenizer.decode(generated) if tokenizer is not None else None
        return outputs

    def _beam_search_step(self, instances: list[BeamSearchInstance]) -> None:
        num_candidates = max(inst.num_candidates for inst in instances)
        step_params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            logprobs=num_candidates,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        beams = [beam for inst in instances for beam in inst.running]
        prompts: list[PromptType] = [{"prompt_token_ids": beam.tokens} for beam in beams]
        request_ids = self._add_requests(prompts, [step_params] * len(beams), None, None)
        outputs = iter(self._run_engine(request_ids, use_tqdm=False))
        for inst in instances:
            tops = []
            for _ in inst.running:
                position = next(outputs).outputs[0].logprobs[0]  # type: ignore[union-attr]
                ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
                tops.append({t: lp.logprob for t, lp in ranked[: inst.num_candidates]})
            inst.advance(tops)

    def _prompt_token_ids(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        text = prompt if isinstance(prompt, str) else prompt["prompt"]
        return list(self.get_tokenizer()(text).input_ids)

    def _add_requests(
        self,
        prompts: list[PromptType],
        params_list: Sequence[SamplingParams | PoolingParams],
        lora_request: Any,
        priority: Sequence[int] | None,
    ) -> list[str]:
        """Adds every request, or none: a bad one aborts those already added."""
        if self.llm_engine.is_sleeping():  # nothing else could wake it: it would hang
            raise RuntimeError("The engine is asleep: call wake_up() before generating.")
        # One adapter (or None) for every prompt, or a list with one per prompt (vLLM).
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts.")
        request_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(
                    request_id,
                    prompt,
                    params,
                    lora_request=loras[i],
                    priority=0 if priority is None else priority[i],
                )
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            self.llm_engine.step()  # drain the abort outputs
            raise
        return request_ids

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=False,
            )
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(
        self, request_ids: list[str], use_tqdm: bool
    ) -> list[RequestOutput | PoolingRequestOutput]:
        results: dict[str, RequestOutput | PoolingRequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        with bar:
            while len(results) < len(wanted) and self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in wanted:
                        results[output.request_id] = output
                        bar.update(1)
        return [results[rid] for rid in request_ids if rid in results]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt(params: Any, kind: type, num_prompts: int, name: str) -> list[Any]:
    """One params object per prompt: a single one is shared, a sequence must match."""
    if isinstance(params, kind):
        return [params] * num_prompts
    params_list = list(params)
    if len(params_list) != num_prompts:
        raise ValueError(f"{name} has {len(params_list)} entries for {num_prompts} prompts.")
    return params_list
