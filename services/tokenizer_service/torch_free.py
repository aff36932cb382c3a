"""Keeps torch out of the tokenizer service's process.

The tokenizer service needs transformers only for tokenizers, chat templates and generation
configs, but transformers imports torch whenever torch is installed (it is, beside the engine):
about 1.3 s of start-up and a few hundred MB of resident memory for a tier that is meant to
scale out cheaply. `hide_torch()` marks torch as absent for this process before transformers is
first imported (`sys.modules["torch"] = None` is how importlib spells "not installed":
`import torch` raises ImportError and `importlib.util.find_spec("torch")` returns None), so
transformers runs in its tokenizers-only mode. It is called by the tokenizer service's entry
point only, never by library code: a test process that also runs an engine keeps its torch.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def hide_torch() -> bool:
    """Makes torch unimportable in this process; False (and nothing changed) when torch or
    transformers is already loaded, as in a process that also hosts an engine."""
    loaded = [name for name in ("torch", "transformers") if sys.modules.get(name) is not None]
    if loaded:
        logger.debug("torch stays importable: %s already imported", ", ".join(loaded))
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers says once, at import, that it runs without PyTorch: expected here.
    logging.getLogger("transformers").addFilter(
        lambda record: "PyTorch was not found" not in record.getMessage()
    )
    return True
