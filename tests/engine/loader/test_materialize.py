"""`engine.loader.materialize.to_empty` gives what `nn.Module.to_empty` gives (names, kinds,
shapes, strides, dtypes, devices, requires_grad; a non-contiguous meta tensor included), and
a fresh process that materialises a meta-built model has not imported sympy, which
`nn.Module.to_empty` imports (engine/loader/materialize.py)."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from tests.services.processes import ROOT, child_env


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 12, dtype=torch.bfloat16)
        self.norm = nn.LayerNorm(12)
        self.frozen = nn.Parameter(torch.empty(3, 5), requires_grad=False)
        self.register_buffer("table", torch.empty(6, 4, dtype=torch.int32))
        self.register_buffer("transposed", torch.empty(4, 6).t())  # not contiguous
        self.register_buffer("nothing", torch.empty(0))


def _described(model: nn.Module) -> list[tuple]:
    tensors = [("param", n, t) for n, t in model.named_parameters()]
    tensors += [("buffer", n, t) for n, t in model.named_buffers()]
    return [
        (kind, name, type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
        for kind, name, t in tensors
    ]


def test_it_materialises_as_to_empty_does():
    from engine.loader.materialize import to_empty

    with torch.device("meta"):
        ours, theirs = _Model(), _Model()
    ours = to_empty(ours, torch.device("cpu"))
    theirs = theirs.to_empty(device=torch.device("cpu"))
    assert _described(ours) == _described(theirs)
    assert all(t.device.type == "cpu" for t in ours.parameters())
    assert ours.transposed.stride() == (1, 6)  # the meta tensor's own strides


MATERIALISE = """
import sys
import torch
from torch import nn
from engine.loader.materialize import to_empty
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
to_empty(model, "cpu")
assert model[0].weight.device.type == "cpu"
print("sympy" in sys.modules)
"""


def test_it_does_not_import_sympy():
    proc = subprocess.run(
        [sys.executable, "-c", MATERIALISE],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"
