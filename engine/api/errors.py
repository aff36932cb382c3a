"""Errors the engine raises that its callers catch by type. Torch-free, so importing one costs
nothing: the tokenizer service maps `EngineDeadError` to UNAVAILABLE without loading the engine."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step raised, or `shutdown()` was called): no request
    can be served any more. `__cause__` holds the error that killed it, if one did."""
