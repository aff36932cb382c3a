"""Executors: where the model runs for an engine (vLLM's `distributed_executor_backend`).

- uniproc: the model runner in the engine's own process.
- mp_executor + worker_proc: one worker process per tensor/pipeline-parallel rank; the driver
  sends each step as a `step_delta` (what changed since the last step) and keeps grammars on
  the driver (grammar_masks); rank_procs stops and names the rank processes; start_method
  (`PAGEDSERVE_WORKER_MULTIPROC_METHOD`) chooses how they start: forked from rank_forkserver,
  a server that has imported torch and the rank's modules once, or spawned.
- Everything besides steps (LoRA, sleep mode, profiling, collective stats) is
  `collective_rpc(method, args, kwargs)` on either executor: the `Worker` method of that name
  on every rank, one result per rank (rank_rpc: the messages and how a rank's exception
  comes back).

The model-side collectives and sharding the ranks run are in `engine.distributed`.
"""
