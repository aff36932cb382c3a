#!/usr/bin/env bash
# The GPU run of issue 33 as one non-interactive command (docs/gpu.md): about 8 minutes on
# one H100 or H200, every result under $OUT, printed as it goes. Each part has its own
# timeout, capped by what is left of the whole budget (GPU_CHECK_BUDGET seconds, 480), so a
# hang costs that part only. The parts, most important first:
#
#   env          nvidia-smi; torch, triton, CUDA and driver versions
#   wheels       installs .gpu_wheels/ (scripts/gpu_wheels.sh, carried) if present
#   tests_gpu    the CUDA-graph token test, the Triton backend against torch, sleep on CUDA
#   decode       batch-1 decode of the Llama-3.1-8B shape, graphs vs eager, + a profile
#   kernels      benchmarks/gpu/kernel_bandwidth.py: bandwidth of each kernel
#   throughput   offline throughput of the 8B shape, graphs vs eager, + transformers
#   tests_kernels  tests/kernels at full size
#
#   OUT=/tmp/out scripts/gpu_check.sh             # everything
#   OUT=/tmp/out scripts/gpu_check.sh decode kernels   # only these parts
#
#   GPU_CHECK_SMOKE=1 scripts/gpu_check.sh decode throughput   # the wiring, tiny, on CPU
#
# $OUT/summary.txt lists each part's exit status and seconds; $OUT/<part>.log its output.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-480}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
START=$(date +%s)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/proto${PYTHONPATH:+:$PYTHONPATH}"
PARTS=("$@")

wanted() {  # wanted NAME: true when no parts were named, or NAME was
    [ ${#PARTS[@]} -eq 0 ] && return 0
    local p
    for p in "${PARTS[@]}"; do [ "$p" = "$1" ] && return 0; done
    return 1
}

# part NAME LIMIT CMD...: runs CMD under `timeout`, output to the screen and $OUT/NAME.log
# (a shell function as CMD runs in a child bash: the functions below are exported).
part() {
    local name=$1 limit=$2 left rc began
    shift 2
    wanted "$name" || [ "$name" = wheels ] || return 0
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped, ${left}s of the budget left" | tee -a "$SUMMARY"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (timeout ${limit}s, $((BUDGET - left))s into the run) ==="
    began=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && rc="124 (timed out)"
    echo "=== $name: rc=$rc in $(($(date +%s) - began))s" | tee -a "$SUMMARY"
}

env_report() {
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
        --format=csv
    "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton missing:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs",
          f"sm_{p.major}{p.minor}")
else:
    print("NO CUDA DEVICE")
EOF
}

install_wheels() {
    if ! ls .gpu_wheels/*.whl >/dev/null 2>&1; then
        echo "no .gpu_wheels/ carried: using the image's packages only"
        return 0
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_site .gpu_wheels/*.whl || return 1
    PYTHONPATH="/tmp/gpu_site:$PYTHONPATH" "$PY" -c \
        "import gguf, opentelemetry.sdk, xgrammar, grpc, google.protobuf as p, engine; print('imports ok; protobuf', p.__version__)"
}

export -f env_report install_wheels
export PY
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=60)
DECODE_ARGS=(--part decode --cuda-graph-sizes 1 2 4 8 --profile-dir "$OUT/profile"
    --output-json "$OUT/decode.json")
THROUGHPUT_ARGS=(--part throughput --num-prompts 200 --input-len 1024 --output-len 128
    --hf-prompts 16 --output-json "$OUT/throughput.json")

if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then  # a tiny model and sizes: checks the wiring
    SMALL=(--shape tiny --max-model-len 256 --kv-cache-gib 0.05 --repeats 1)
    DECODE_ARGS+=("${SMALL[@]}" --decode-tokens 8)
    THROUGHPUT_ARGS+=("${SMALL[@]}" --num-prompts 8 --input-len 64 --output-len 8 --hf-prompts 4)
fi

part env 30 bash -c env_report
part wheels 60 bash -c install_wheels  # always: every later part imports the engine
[ -d /tmp/gpu_site ] && export PYTHONPATH="/tmp/gpu_site:$PYTHONPATH"
part tests_gpu 120 "${PYTEST[@]}" --junitxml="$OUT/tests_gpu.xml" \
    tests/engine/worker/test_cuda_graph_tokens.py \
    tests/kernels/test_engine_triton_backend.py \
    tests/engine/front/test_sleep.py::test_cuda_sleep_gives_device_memory_back
part decode 110 "$PY" benchmarks/gpu/gpu_decode.py "${DECODE_ARGS[@]}"
part kernels 50 "$PY" benchmarks/gpu/kernel_bandwidth.py
part throughput 110 "$PY" benchmarks/gpu/gpu_decode.py "${THROUGHPUT_ARGS[@]}"
part tests_kernels 150 "${PYTEST[@]}" --junitxml="$OUT/tests_kernels.xml" tests/kernels
echo "=== done in $(($(date +%s) - START))s; summary:"
cat "$SUMMARY"
