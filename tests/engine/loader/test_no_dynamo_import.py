"""A CPU engine's process never imports torch._dynamo (nor, through it, triton).

Nothing on the CPU path compiles graphs, yet building a model on the meta device used to
import both: `nn.Embedding`'s random draw on a meta tensor goes through torch's reference
ops, whose first use imports torch._dynamo, which imports triton where it is installed
(≈ 95 MiB of peak RSS for the default engine; docs/engine.md "Memory"). Checked in a fresh
interpreter, for a Llama-style and a Gemma-style model (each builds its own embedding), with
a generate step so that the step's code paths count too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_utils import make_tiny_llama, make_tiny_model

CHECK = """
import json, sys
from engine import LLM, SamplingParams
before = "torch._dynamo" in sys.modules
llm = LLM(model=sys.argv[1], dtype="float32", device="cpu")
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0))
print(json.dumps({"before": before, "dynamo": "torch._dynamo" in sys.modules,
                  "triton": "triton" in sys.modules, "tokens": len(out[0].outputs[0].token_ids)}))
"""


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_cpu_engine_imports_no_dynamo(tmp_path: Path, family: str) -> None:
    if family == "llama":
        model = make_tiny_llama(tmp_path / family)
    else:
        model = make_tiny_model(tmp_path / family, "Gemma2ForCausalLM", head_dim=16)
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(model)],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 3
    assert not result["before"], "importing the engine already imported torch._dynamo"
    assert not result["dynamo"], "building or running the model imported torch._dynamo"
    assert not result["triton"]
