"""Tensor and pipeline parallelism: the ranks' process groups (`parallel_state`), the
collectives the model layers call (`communication`), the worker processes and the driver's
side of them (`mp_executor`, `worker_proc`) and the step description sent each step
(`step_delta`). See docs/parallelism.md."""
