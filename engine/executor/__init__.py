"""Executors: where the model runs for an engine (vLLM's `distributed_executor_backend`).

- uniproc: the model runner in the engine's own process.
- mp_executor + worker_proc: one worker process per tensor/pipeline-parallel rank; the driver
  sends each step as a `step_delta` (what changed since the last step) and keeps grammars on
  the driver (grammar_masks).

The model-side collectives and sharding the ranks run are in `engine.distributed`.
"""
