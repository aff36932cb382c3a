"""An engine service starts without importing transformers or sympy: its modules, and the
engine it loads for a Llama model saved by transformers 5 (the default model's conversion,
the tests' models), read the config from config.json (engine/config/hf_config.py) and give
the meta-built model its storage without `nn.Module.to_empty` (engine/loader/materialize.py).
The two imports cost 2-4 s of each start on a 2-core machine (docs/benchmarks.md, "Engine
start-up"); this guards the gain without timing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.services.processes import KV_CACHE_BYTES, ROOT, child_env

# What `pagedserve engine --model M` does before it serves (services/cli/main.py, run_engine):
# the command's parser and the service's modules, then the engine from the flags.
START_AN_ENGINE = """
import sys
import services.cli.main, services.engine_service.server
from services.cli.flags import build_parser, engine_args_from
from engine import AsyncLLMEngine
assert "transformers" not in sys.modules, "imported by the service's modules"
argv = ["engine", "--model", sys.argv[1], "--kv-cache-memory-bytes", sys.argv[2]]
engine = AsyncLLMEngine.from_engine_args(engine_args_from(build_parser("engine").parse_args(argv)))
try:
    config = engine.engine.get_model_config()
    # sympy: torch imports it for nn.Module.to_empty on meta tensors (engine/loader/materialize.py)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "sympy"))
    assert not loaded, loaded[:5]
    print(type(config.hf_config).__name__, config.hf_config.vocab_size)
finally:
    engine.shutdown()
"""


def test_an_engine_loads_a_llama_model_without_transformers(tiny_model_dir: Path):
    proc = subprocess.run(
        [sys.executable, "-c", START_AN_ENGINE, str(tiny_model_dir), str(KV_CACHE_BYTES)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["LightHFConfig", "49152"], proc.stdout
