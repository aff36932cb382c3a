"""The committed generated code is exactly what scripts/gen_proto.py makes from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_up_to_date(tmp_path):
    gen_proto = _load_gen_proto()
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in gen_proto.generate(tmp_path)}
    proto_root = ROOT / "proto"
    committed = {
        p.relative_to(proto_root): p.read_bytes()
        for p in proto_root.rglob("*")
        if p.name.endswith(gen_proto.GENERATED_SUFFIXES)
    }
    assert sorted(fresh) == sorted(committed), "generated files added or removed"
    stale = [str(path) for path, data in fresh.items() if committed[path] != data]
    assert not stale, f"stale generated code (run `python scripts/gen_proto.py`): {stale}"


def test_generated_imports_read_from_the_package():
    from pagedserve.v1 import engine_pb2_grpc

    text = Path(engine_pb2_grpc.__file__).read_text()
    assert "from pagedserve.v1 import common_pb2" in text
