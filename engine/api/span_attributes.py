"""The attribute names of the request spans, shared by both services: the tokenizer service's
`Generate` span (services/common/tracing.py) and the engine's `llm_request` span
(engine/observability/tracing.py) describe one request in the same words."""

from __future__ import annotations


class SpanAttributes:
    """Attribute names: the GenAI conventions where they exist, ours (`gen_ai.latency.*`,
    as vLLM names them) for the phases."""

    REQUEST_ID = "gen_ai.request.id"
    REQUEST_MODEL = "gen_ai.request.model"
    RESPONSE_MODEL = "gen_ai.response.model"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    TOP_K = "gen_ai.request.top_k"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    N = "gen_ai.request.n"
    SEED = "gen_ai.request.seed"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    CACHED_INPUT_TOKENS = "gen_ai.usage.cached_input_tokens"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    OPERATION = "gen_ai.operation.name"
    SYSTEM = "gen_ai.system"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
    TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"
    E2E = "gen_ai.latency.e2e"
    NUM_PREEMPTIONS = "pagedserve.request.num_preemptions"
    LORA_NAME = "gen_ai.request.lora_name"  # ours: the LoRA adapter, when one is used
    # Ours: who the request was served for (the tenant); with TIME_IN_QUEUE it shows how
    # long fair sharing kept this tenant's request waiting. Absent for the default key.
    FAIRNESS_KEY = "pagedserve.fairness_key"
