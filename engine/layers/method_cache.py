"""The JSON cache of the start-up trials' decisions, keyed by what the timings depend on.

The linear-method trial (engine/layers/linear_select.py) and the quantized-route trial
(engine/layers/quant_select.py) each time their candidates once per weight shape and row
bucket; their decisions are written here, under the model cache root (`linear_methods/`),
keyed by CPU model, ISA flags (and any ISA limit set in the environment), row buckets, torch
version and thread count, so later starts read them and time nothing. A file that is corrupt,
written under another key or names a method or route the reader does not take is ignored
(and rewritten by the trial). Apart from the trials because both read and write the same
files the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.api.model_files import cache_root
from engine.layers.row_buckets import ROW_BUCKETS

logger = logging.getLogger(__name__)

_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile")
# Settings that narrow the ISA the libraries and our kernels use below what the CPU has
# (an emulated AVX2-only machine, benchmarks/offline/throughput.py --emulate-isa): part of the key.
_ISA_LIMIT_ENVS = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "PAGEDSERVE_NATIVE_MARCH",
    "PAGEDSERVE_QUANT_ISA",
)


def cache_key() -> dict[str, Any]:
    """What the measurements depend on: the CPU, its ISA, the torch build, the threads."""
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "model name":
                    model = value.strip()
                elif name.strip() == "flags":
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return {
        "cpu": model or platform.machine(),
        "isa": [f for f in _ISA_FLAGS if f in flags],
        "isa_limits": {name: os.environ[name] for name in _ISA_LIMIT_ENVS if name in os.environ},
        "buckets": [list(b) for b in ROW_BUCKETS],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "linear_methods" / f"{digest}.json"


def read_cache(
    path: Path,
    key: dict[str, Any],
    *,
    names: tuple[str, ...],
    label: str = "linear-method",
) -> dict[str, tuple[str, ...]]:
    """The cached decisions {shape name: one of `names` per row bucket}; {} (with a warning
    naming the `label` cache) for a corrupt file or one written under another key. The
    quantized-route trial (engine/layers/quant_select.py) reads its file here too, with its
    route names."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("written for another CPU/torch/thread count")
        decisions = {}
        for shape, methods in data["decisions"].items():
            if len(methods) != len(ROW_BUCKETS) or not set(methods) <= set(names):
                raise ValueError(f"bad entry for {shape}: {methods}")
            decisions[shape] = tuple(methods)
        return decisions
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("Ignoring the %s cache %s (%s); it is rewritten.", label, path, error)
        return {}


def write_cache(path: Path, key: dict[str, Any], decisions: dict[str, tuple[str, ...]]) -> None:
    """Written to a temporary file and renamed, so a concurrent reader sees all or nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump({"key": key, "decisions": {k: list(v) for k, v in decisions.items()}}, out)
        os.replace(tmp, path)
    except OSError as error:
        logger.warning("Could not write the linear-method cache %s (%s).", path, error)
