"""Generates the Python code of the gRPC API from `proto/` (messages, stubs, .pyi types).

    python scripts/gen_proto.py            # writes next to the protos (the committed copy)
    python scripts/gen_proto.py --out DIR  # writes under DIR instead (the freshness test)

The output is committed (see docs/grpc.md): `proto/pagedserve/v1/*_pb2.py`, `*_pb2_grpc.py`
and `*_pb2.pyi`. Protos are compiled with `-I proto`, so generated imports read
`from pagedserve.v1 import common_pb2`. Never edit the output by hand; change the .proto
and run this script. It needs grpcio-tools pinned to the grpcio version (pyproject `dev`).
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files to compile, relative to `proto_root`, in a stable order."""
    return sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compiles every .proto under `proto_root` into `out_dir`; returns the files written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    files = [str(p) for p in proto_files(proto_root)]
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
