#!/usr/bin/env bash
# `ls -laR` on a fast S3 server, where the mount and not the server is what is measured.
#
#   bench/ls_fast.sh [--dirs N] [--files N] [--rtt MS] [--runs N] [--baseline BIN] [--no-build]
#
# moto answers ~350 HEADs/s on one core, so on bench/run.sh's moto rows every mount that
# honours stored metadata (s3csi, s3fs) measures moto's HEAD rate. Here the embedded
# `s3csi s3-server` serves instead, behind the latency proxy (`s3bench proxy`, default RTT
# 10 ms), pinned to the last CPU like run.sh's server side. Two trees of DIRS x FILES
# objects: one without metadata (as `aws s3 sync` writes them), one with s3fs metadata on
# every object. Rows, one fresh mount each, medians of RUNS:
#   s3csi                    metadata honoured (the default)
#   s3csi --ignore-metadata  the listing alone: what `ls -laR` cost before metadata was read
#   baseline [--ignore-metadata]  another s3csi binary (--baseline BIN), e.g. the previous
#                            landing, for "today's time"
#   s3fs                     if installed
# Prints a Markdown table and writes it to bench/results/ls-fast-latest.md.
set -uo pipefail
cd "$(dirname "$0")/.."
DIRS=100 FILES=100 RTT=10 RUNS=3 BASELINE="" BUILD=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dirs) DIRS=$2; shift ;;
    --files) FILES=$2; shift ;;
    --rtt) RTT=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --baseline) BASELINE=$2; shift ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$BUILD" = 1 ] && { cargo build --release --bins -q || exit 1; }
WORK=$(mktemp -d /tmp/lsfast.XXXXXX)
cp target/release/s3csi target/release/s3bench "$WORK/" || exit 1
[ -n "$BASELINE" ] && { cp "$BASELINE" "$WORK/baseline" || exit 1; }
export AWS_ACCESS_KEY_ID=s3csi-demo AWS_SECRET_ACCESS_KEY=s3csi-demo-secret AWS_REGION=us-east-1
export S3CSI_S3_SECRET_KEY=$AWS_SECRET_ACCESS_KEY RUST_BACKTRACE=0
log() { echo "[$(date +%T)] $*" >&2; }
NCPU=$(nproc)
SERVER=() CLIENT=()
if [ "$NCPU" -ge 2 ] && command -v taskset >/dev/null; then
  SERVER=(taskset -c "$((NCPU - 1))") CLIENT=(taskset -c "0-$((NCPU - 2))")
fi
PIDS=() MNT=$WORK/mnt
cleanup() {
  mountpoint -q "$MNT" && { fusermount3 -u "$MNT" 2>/dev/null || umount -l "$MNT"; }
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK/data"
}
trap cleanup EXIT

"${SERVER[@]}" "$WORK/s3csi" s3-server --listen 127.0.0.1:0 --dir "$WORK/data" --bucket bench \
  --log-level warn >"$WORK/server.out" 2>"$WORK/server.log" &
PIDS+=($!)
for _ in $(seq 100); do grep -q '^listening on' "$WORK/server.out" && break; sleep 0.1; done
DIRECT=$(sed -n 's/^listening on //p' "$WORK/server.out" | head -1)
[ -n "$DIRECT" ] || { echo "the embedded server did not start" >&2; cat "$WORK/server.log" >&2; exit 1; }
PPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"${SERVER[@]}" "$WORK/s3bench" proxy --listen "127.0.0.1:$PPORT" --upstream "${DIRECT#http://}" \
  --delay-ms $((RTT / 2)) >/dev/null 2>&1 &
PIDS+=($!)
sleep 0.3
log "embedded server $DIRECT, proxy :$PPORT (RTT $RTT ms); $((DIRS * FILES)) objects per tree"
"$WORK/s3bench" populate --endpoint "$DIRECT" --bucket bench --prefix tree --dirs "$DIRS" --files "$FILES" >/dev/null || exit 1
"$WORK/s3bench" populate --endpoint "$DIRECT" --bucket bench --prefix mtree --dirs "$DIRS" --files "$FILES" --with-metadata >/dev/null || exit 1
printf '%s:%s\n' "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" >"$WORK/passwd-s3fs"
chmod 600 "$WORK/passwd-s3fs"
mkdir -p "$MNT"

mount_one() { # NAME: starts that client's mount on $MNT
  local ep="http://127.0.0.1:$PPORT"
  case $1 in
    s3csi) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style bench "$MNT" ;;
    s3csi-ignore) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style --ignore-metadata bench "$MNT" ;;
    baseline) "${CLIENT[@]}" "$WORK/baseline" mount --foreground --endpoint-url "$ep" --force-path-style bench "$MNT" ;;
    baseline-ignore) "${CLIENT[@]}" "$WORK/baseline" mount --foreground --endpoint-url "$ep" --force-path-style --ignore-metadata bench "$MNT" ;;
    s3fs) "${CLIENT[@]}" s3fs bench "$MNT" -f -o "url=$ep,use_path_request_style,passwd_file=$WORK/passwd-s3fs" ;;
  esac >>"$WORK/$1.log" 2>&1 &
  FSPID=$!
  for _ in $(seq 150); do mountpoint -q "$MNT" && return 0; kill -0 "$FSPID" 2>/dev/null || break; sleep 0.1; done
  echo "$1 did not mount (see $WORK/$1.log)" >&2
  return 1
}
umount_one() {
  fusermount3 -u "$MNT" 2>/dev/null || umount "$MNT" 2>/dev/null || umount -l "$MNT"
  for _ in $(seq 100); do kill -0 "$FSPID" 2>/dev/null || break; sleep 0.1; done
  kill "$FSPID" 2>/dev/null; wait "$FSPID" 2>/dev/null
}

CLIENTS="s3csi s3csi-ignore"
[ -n "$BASELINE" ] && CLIENTS="$CLIENTS baseline baseline-ignore"
command -v s3fs >/dev/null && CLIENTS="$CLIENTS s3fs"
declare -A T
for run in $(seq "$RUNS"); do
  for c in $CLIENTS; do
    for tree in tree mtree; do
      mount_one "$c" || continue
      sync
      t0=$(date +%s.%N)
      n=$("${CLIENT[@]}" ls -laR "$MNT/$tree" 2>/dev/null | grep -c '^-')
      t1=$(date +%s.%N)
      umount_one
      secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
      [ "$n" = $((DIRS * FILES)) ] || secs="error($n)"
      T[$c,$tree]="${T[$c,$tree]:-} $secs"
      log "run $run: $c $tree: $secs s"
    done
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { if (NR) print a[int((NR + 1) / 2)] }'; }
OUT=bench/results/ls-fast-latest.md
{
  echo "ls -laR of $((DIRS * FILES)) objects in $DIRS directories on the embedded S3 server, RTT $RTT ms, median of $RUNS fresh mounts (s)"
  echo
  echo "| client | no metadata | s3fs metadata on every object |"
  echo "|---|---|---|"
  for c in $CLIENTS; do
    echo "| $c | $(echo "${T[$c,tree]:-}" | median) | $(echo "${T[$c,mtree]:-}" | median) |"
  done
} | tee "$OUT"
