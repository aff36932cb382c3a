"""Tensor and pipeline parallelism, the model's side: the ranks' process groups
(`parallel_state`, and `CollectiveError` for a collective a dead peer broke), the collectives
the model layers call (`communication`), which part of the model each rank holds
(`sharding`) and one pipeline stage's share of a forward pass (`stage`). The rank processes,
the driver's side of them and the step sent each step are in `engine.executor`. See
docs/parallelism.md."""
