#!/usr/bin/env bash
# The GPU check as one non-interactive command (docs/gpu.md): about 8 minutes on one H100 or
# H200. Each part has its own timeout, capped by what is left of the whole budget
# (GPU_CHECK_BUDGET seconds, 480), so a hang costs that part only. The parts, most
# important first:
#
#   env            nvidia-smi; torch, triton, CUDA and driver versions
#   wheels         installs .gpu_wheels/ (scripts/gpu_wheels.sh) if present
#   tests_gpu      the CUDA-graph tokens, the default GPU start, the Triton backend against
#                  torch, sleep on CUDA
#   serving        benchmarks/gpu/serving_sweep.py: both services started as README and
#                  docker/compose.gpu.yml start them (default flags), health, a chat answer,
#                  `pagedserve bench serve` at concurrency 1, 16, 64, 256 (128 in / 256 out)
#                  with the services' CPU seconds, beside the same requests in process
#   throughput     benchmarks/gpu/gpu_decode.py: batch-1 decode (graphs vs eager, a profile),
#                  then offline throughput per ISL x OSL (x prompts): a warm-up run and three
#                  timed runs each, the spread, the roofline bound, TensorRT-LLM's FP8 table
#   step_kernels   benchmarks/gpu/step_kernels.py: prefill attention TFLOP/s (B=4 x 2048,
#                  flash_prefill vs the old tiles vs SDPA), rotary + KV write of a batch-200
#                  decode step (torch / kernel / fused, in a CUDA graph), the profile of a
#                  batch-200 decode step with the aten kernels left
#   tests_kernels  tests/kernels at full size
#   kernels        benchmarks/gpu/kernel_bandwidth.py: bandwidth of each kernel
#   int4           (int4_routes) benchmarks/gpu/int4_linear.py: the INT4 layer's kernel
#                  against dequantize + cuBLAS per row count (1 .. 128) on the 8B shapes, GB/s
#                  and share of the copy bandwidth, the crossovers; then
#                  benchmarks/gpu/int4_decode.py: the 8B shape from a random INT4 (GPTQ)
#                  checkpoint: the engine's measured crossovers, batch-1 ms/token, a decode
#                  step at batch 200, offline tok/s beside TensorRT-LLM's FP8 table (the JSON
#                  of both goes into logs.tar.gz)
#   fp8            (fp8_routes) benchmarks/gpu/fp8_gemm.py --part routes: the FP8 GEMV
#                  against quantize + _scaled_mm per row count (1 .. 128) on the 8B shapes,
#                  GB/s and share of the copy bandwidth, the crossovers; then
#                  benchmarks/gpu/fp8_decode.py: the 8B shape in FP8 (compressed-tensors
#                  FP8_DYNAMIC, random weights): the engine's measured crossovers, batch-1
#                  ms/token with the GEMV and with _scaled_mm only, a decode step at batch
#                  200, offline 128/128, 1000/1000, 2048/128 beside TensorRT-LLM's FP8 table;
#                  and (fp8_block) benchmarks/gpu/fp8_block_gemm.py: the block-scaled FP8
#                  GEMMs (128 x 128 blocks, W8A16 and on sm_89+ W8A8) against bf16 at 1 ..
#                  4096 rows on the 8B shapes, us, GB/s, share of the copy bandwidth,
#                  TFLOP/s, the first row count W8A8 wins per shape; and (fp8_moe)
#                  benchmarks/gpu/fp8_moe.py: one MoE layer's grouped GEMMs with FP8 experts
#                  (128 x 128 blocks, W8A16 and on sm_89+ W8A8) against bf16 experts at 1,
#                  16, 64, 256, 1024 tokens on the Qwen3-30B-A3B and DeepSeek-V3 expert
#                  shapes, us, GB/s, share of copy
#
#   batch_invariant  benchmarks/gpu/batch_invariant_decode.py: the 8B shape's decode step at
#                  batch 1 and 200 with batch_invariant off and on, and the probe alone ==
#                  in a batch of 200 (rc 1 if not); then (batch_invariant_tests)
#                  tests/engine/batch_invariant/test_triton_backend.py and the invariant
#                  kernels' tests on the GPU
#   async_scheduling  benchmarks/gpu/async_scheduling_decode.py: the 8B shape's batch-1
#                  ms/token and batch-200 decode step with async_scheduling off and on, and
#                  the same greedy tokens both ways (rc 1 if not); then
#                  (async_scheduling_tests) the equality tests on the GPU
#
# The parts from step_kernels on the list below tests_kernels (step_kernels, int4, fp8,
# batch_invariant, async_scheduling) measure one piece of work each and run only when named, alone or as the
# group `issues`, so the default check (the product as users start it) keeps to its budget.
#
#   OUT=/tmp/out scripts/gpu_check.sh                    # the default check
#   OUT=/tmp/out scripts/gpu_check.sh serving tests_gpu  # only these parts
#   OUT=/tmp/out scripts/gpu_check.sh issues             # every part run on request
#   GPU_CHECK_SMOKE=1 scripts/gpu_check.sh               # the wiring, tiny, on a CPU
#
# $OUT holds at most 6 files: summary.txt (each part's exit status and seconds),
# console.log (everything printed), serving.json, gpu_decode.json, step_kernels.json and
# logs.tar.gz (each part's log, the JUnit XML of the tests, the services' log, the profile
# tables).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-python3}
SMOKE=${GPU_CHECK_SMOKE:-0}
# A smoke run on a CPU is slower than the GPU run it stands for: its limits are SCALE times.
if [ "$SMOKE" = 1 ]; then BUDGET=${GPU_CHECK_BUDGET:-1500}; SCALE=4; else BUDGET=${GPU_CHECK_BUDGET:-480}; SCALE=1; fi
WORKLOADS=${GPU_CHECK_WORKLOADS:-1024x128x200 128x128x256 2048x128x32}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_check_work.XXXXXX)  # everything but the five files: tarred at exit
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
exec > >(tee "$OUT/console.log") 2>&1
trap 'tar -czf "$OUT/logs.tar.gz" -C "$WORK" . && rm -rf "$WORK"' EXIT
START=$(date +%s)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/proto${PYTHONPATH:+:$PYTHONPATH}"
PARTS=("$@")

ON_REQUEST=" step_kernels int4_routes int4 fp8_routes fp8 fp8_block fp8_moe batch_invariant batch_invariant_tests async_scheduling async_scheduling_tests "  # run only when named (or `issues`)

wanted() {  # wanted NAME: NAME was named; or no part was and NAME is in the default check
    local p on_request=0
    [[ "$ON_REQUEST" == *" $1 "* ]] && on_request=1
    [ ${#PARTS[@]} -eq 0 ] && [ "$on_request" = 0 ] && return 0
    for p in "${PARTS[@]}"; do
        [ "$p" = "$1" ] && return 0
        [ "$p" = issues ] && [ "$on_request" = 1 ] && return 0
    done
    return 1
}

# part NAME LIMIT CMD...: runs CMD under `timeout`, output to the screen and $WORK/NAME.log
# (a shell function as CMD runs in a child bash: the functions below are exported).
part() {
    local name=$1 limit=$(($2 * SCALE)) left rc began
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
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && rc="124 (timed out)"
    echo "=== $name: rc=$rc in $(($(date +%s) - began))s" | tee -a "$SUMMARY"
}

env_report() {
    nvidia-smi || echo "no nvidia-smi"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
        --format=csv 2>/dev/null
    "$PY" - <<'EOF'
import os, platform, torch
print("python", platform.python_version(), "CPUs", os.cpu_count())
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
        echo "no .gpu_wheels/: using the image's packages only"
        return 0
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_site .gpu_wheels/*.whl || return 1
    PYTHONPATH="/tmp/gpu_site:$PYTHONPATH" "$PY" -c \
        "import gguf, opentelemetry.sdk, xgrammar, grpc, psutil, google.protobuf as p, engine; print('imports ok; protobuf', p.__version__)"
}

export -f env_report install_wheels
export PY
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=60)
TESTS_GPU=(tests/engine/worker/test_cuda_graph_tokens.py
    tests/engine/worker/test_cuda_default_start.py
    tests/kernels/test_engine_triton_backend.py
    tests/engine/front/test_sleep.py::test_cuda_sleep_gives_device_memory_back)
TESTS_KERNELS=(tests/kernels)
SERVING_ARGS=(--concurrency 1 16 64 256 --input-len 128 --output-len 256)
# shellcheck disable=SC2206  # the workloads are words
DECODE_ARGS=(--part all --workloads $WORKLOADS --hf-prompts 16 --profile-dir "$WORK/profile")
KERNELS=("$PY" benchmarks/gpu/kernel_bandwidth.py)
INT4_ARGS=(--part all --workloads 128x128x256 2048x128x32 1000x1000x32 --repeats 1
    --decode-tokens 64 --batch-requests 200)
INT4_ROUTES=("$PY" benchmarks/gpu/int4_linear.py --output-json "$WORK/int4_routes.json")
FP8_ROUTES=("$PY" benchmarks/gpu/fp8_gemm.py --part routes --output-json "$WORK/fp8_routes.json")
STEP_KERNELS=("$PY" benchmarks/gpu/step_kernels.py --profile-dir "$WORK/profile")
FP8_BLOCK=("$PY" benchmarks/gpu/fp8_block_gemm.py --output-json "$WORK/fp8_block_gemm.json")
FP8_MOE=("$PY" benchmarks/gpu/fp8_moe.py --output-json "$WORK/fp8_moe.json")
FP8_ARGS=(--repeats 1 --workloads 128x128x256 1000x1000x128 2048x128x64 --batch 200
    --output-json "$WORK/fp8_decode.json")
INVARIANT=("$PY" benchmarks/gpu/batch_invariant_decode.py --batches 1 200 --decode-tokens 32)
TESTS_INVARIANT=(tests/engine/batch_invariant/test_triton_backend.py
    tests/kernels/test_batch_invariant_matmul.py tests/kernels/test_batch_invariant_attention.py
    tests/kernels/test_row_kernels_are_batch_invariant.py)
ASYNC=("$PY" benchmarks/gpu/async_scheduling_decode.py --batches 1 200 --decode-tokens 32)
# the equality tests built on the GPU (their CPU twins run in the CPU suite), and the
# pinned-copy logic
TESTS_ASYNC=(tests/engine/front/test_async_scheduling.py tests/engine/worker/test_async_output.py
    -k "cuda or pinned or host_copy")

if [ "$SMOKE" = 1 ]; then  # a tiny model and counts: the wiring, on any machine
    SERVING_ARGS=(--shape tiny --concurrency 1 2 --input-len 16 --output-len 8)
    DECODE_ARGS=(--part all --shape tiny --max-model-len 256 --kv-cache-gib 0.05 --repeats 2
        --decode-tokens 4 --prompt-len 16 --workloads 16x4x4 32x4x2 --hf-prompts 2
        --profile-dir "$WORK/profile")
    TESTS_GPU=("${TESTS_GPU[@]:0:2}")  # collected and skipped: the Triton backend's tests
    TESTS_KERNELS=(tests/kernels/test_fused_moe.py)  # take minutes in the interpreter
    KERNELS=("$PY" benchmarks/gpu/kernel_bandwidth.py --help)  # CUDA only: does it start?
    INT4_ARGS=(--part all --shape tiny --group-size 32 --max-model-len 256 --kv-cache-gib 0.05
        --repeats 2 --decode-tokens 4 --prompt-len 16 --batch-requests 8 --workloads 16x4x4)
    STEP_KERNELS+=(--smoke)  # tiny shapes, the kernels in Triton's interpreter
    INT4_ROUTES+=(--smoke --rows 1 2 4)  # tiny shapes, the kernels in Triton's interpreter
    FP8_ROUTES+=(--smoke --route-rows 1 2 4)
    FP8_BLOCK+=(--smoke --rows 1 16)  # tiny shapes, the kernel in Triton's interpreter
    FP8_MOE+=(--smoke)  # tiny experts, the kernels in Triton's interpreter
    FP8_ARGS=(--shape tiny --max-model-len 256 --kv-cache-gib 0.05 --repeats 1 --decode-tokens 4
        --prompt-len 16 --workloads 16x4x4 --batch 4 --fp8-compute fp8
        --output-json "$WORK/fp8_decode.json")  # the FP8 path on a CPU
    # the GPU's path (the triton backend's invariant kernels) in Triton's interpreter
    INVARIANT=(env TRITON_INTERPRET=1 "$PY" benchmarks/gpu/batch_invariant_decode.py --shape tiny
        --device cpu --dtype float32 --attention-backend triton --batches 1 2 --prompt-len 16 --decode-tokens 2 --max-model-len 256 --kv-cache-gib 0.05)
    TESTS_INVARIANT=(tests/kernels/test_batch_invariant_matmul.py)
    ASYNC=("$PY" benchmarks/gpu/async_scheduling_decode.py --shape tiny --device cpu
        --dtype float32 --batches 1 4 --prompt-len 16 --decode-tokens 4 --repeats 1
        --max-model-len 256 --kv-cache-gib 0.05)
    TESTS_ASYNC=(tests/engine/worker/test_async_output.py)
fi

part env 30 bash -c env_report
part wheels 60 bash -c install_wheels  # always: every later part imports the engine
[ -d /tmp/gpu_site ] && export PYTHONPATH="/tmp/gpu_site:$PYTHONPATH"
part tests_gpu 120 "${PYTEST[@]}" --junitxml="$WORK/tests_gpu.xml" "${TESTS_GPU[@]}"
part serving 170 "$PY" benchmarks/gpu/serving_sweep.py "${SERVING_ARGS[@]}" \
    --output-json "$OUT/serving.json" --log-dir "$WORK/serving"
part throughput 140 "$PY" benchmarks/gpu/gpu_decode.py "${DECODE_ARGS[@]}" \
    --output-json "$OUT/gpu_decode.json"
part step_kernels 150 "${STEP_KERNELS[@]}" --output-json "$OUT/step_kernels.json"
part tests_kernels 150 "${PYTEST[@]}" --junitxml="$WORK/tests_kernels.xml" "${TESTS_KERNELS[@]}"
part kernels 40 "${KERNELS[@]}"
wanted int4 && PARTS+=(int4_routes)  # the layer's two routes: part of the same request
part int4_routes 60 "${INT4_ROUTES[@]}"
part int4 240 "$PY" benchmarks/gpu/int4_decode.py "${INT4_ARGS[@]}" \
    --output-json "$WORK/int4_decode.json"
wanted fp8 && PARTS+=(fp8_routes)  # the layer's two routes: part of the same request
part fp8_routes 90 "${FP8_ROUTES[@]}"
part fp8 180 "$PY" benchmarks/gpu/fp8_decode.py "${FP8_ARGS[@]}"
wanted fp8 && PARTS+=(fp8_block)  # the block-scaled GEMM: part of the same request
part fp8_block 240 "${FP8_BLOCK[@]}"
wanted fp8 && PARTS+=(fp8_moe)  # the FP8 experts' grouped GEMM: the same request
part fp8_moe 180 "${FP8_MOE[@]}"
part batch_invariant 240 "${INVARIANT[@]}" --output-json "$WORK/batch_invariant_decode.json"
wanted batch_invariant && PARTS+=(batch_invariant_tests)  # its tests: part of the same request
part batch_invariant_tests 150 "${PYTEST[@]}" --junitxml="$WORK/tests_invariant.xml" \
    "${TESTS_INVARIANT[@]}"
part async_scheduling 200 "${ASYNC[@]}" --output-json "$WORK/async_scheduling_decode.json"
wanted async_scheduling && PARTS+=(async_scheduling_tests)  # its tests: the same request
part async_scheduling_tests 150 "${PYTEST[@]}" --junitxml="$WORK/tests_async.xml" \
    "${TESTS_ASYNC[@]}"
echo "=== done in $(($(date +%s) - START))s; summary:"
cat "$SUMMARY"
