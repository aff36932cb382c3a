"""`pagedserve:lora_requests_info`: which adapters the running and waiting requests use, in
the shape vLLM exports and the Kubernetes inference gateway reads for LoRA-aware routing.

One sample, valued at the time of the update, with labels ``max_lora`` (adapters per
batch), ``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated adapter
names). The previous label set is dropped at each update, so only the current one shows.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge


class LoRAInfoGauge:
    def __init__(self, registry: CollectorRegistry, max_loras: int) -> None:
        self.max_loras = max_loras
        self._gauge = Gauge(
            "pagedserve:lora_requests_info",
            "Running and waiting LoRA adapters (value: time of the update).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=registry,
        )
        self._labels: tuple[str, str] | None = None

    def update(self, running: Iterable[Any], waiting: Iterable[Any]) -> None:
        """`running` / `waiting`: the scheduler's requests (with `lora_request`)."""
        labels = (_names(running), _names(waiting))
        if labels != self._labels:
            self._gauge.clear()
            self._labels = labels
        self._gauge.labels(str(self.max_loras), *labels).set(time.time())


def _names(requests: Iterable[Any]) -> str:
    names = {r.lora_request.lora_name for r in requests if r.lora_request is not None}
    return ",".join(sorted(names))
