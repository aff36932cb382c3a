"""The tokenizer that stop strings are matched with.

An engine built with `skip_tokenizer_init=True` (the gRPC engine service: token ids in,
token ids out) has no tokenizer, yet a caller of vLLM's engine protocol may send stop
strings, as vLLM's own engine honours them. Matching them needs incremental
detokenization, so the model directory's tokenizer is loaded the first time a request
asks for stop strings (never for the pagedserve tokenizer service's requests, which match
stop strings themselves and send none). Without tokenizer files the request is refused
with a ValueError naming `stop`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from engine.api.model_files import load_tokenizer


class StopStringTokenizer:
    def __init__(self, tokenizer: Any | None, source_dir: str | Path) -> None:
        self._tokenizer = tokenizer
        self._source_dir = source_dir
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        """The engine's tokenizer, else the model directory's (loaded once)."""
        if self._tokenizer is not None:
            return self._tokenizer
        with self._lock:
            if self._tokenizer is None:
                tokenizer = load_tokenizer(Path(self._source_dir))
                if tokenizer is None:
                    raise ValueError(
                        "stop: stop strings need the model's tokenizer, and "
                        f"{self._source_dir} has no tokenizer files; use stop_token_ids."
                    )
                self._tokenizer = tokenizer
        return self._tokenizer
