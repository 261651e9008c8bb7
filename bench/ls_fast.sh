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
#   s3csi                    metadata honoured (the default), a fresh --cache-dir: the first walk
#   s3csi remount            the same after a remount of the same --cache-dir (the metadata of
#                            the versions read is known: `known-versions`)
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
[ "$BUILD" = 1 ] && { cargo build --release --workspace --bins -q || exit 1; }
WORK=$(mktemp -d /tmp/lsfast.XXXXXX)
cp target/release/s3csi target/release/s3bench "$WORK/" || exit 1
[ -n "$BASELINE" ] && { cp "$BASELINE" "$WORK/baseline" || exit 1; }
# shellcheck source=bench/embedded.sh
source bench/embedded.sh
log "embedded server $DIRECT, proxy :$PPORT (RTT $RTT ms); $((DIRS * FILES)) objects per tree"
"$WORK/s3bench" populate --endpoint "$DIRECT" --bucket bench --prefix tree --dirs "$DIRS" --files "$FILES" >/dev/null || exit 1
"$WORK/s3bench" populate --endpoint "$DIRECT" --bucket bench --prefix mtree --dirs "$DIRS" --files "$FILES" --with-metadata >/dev/null || exit 1

mount_one() { # NAME [CACHE_DIR]: starts that client's mount on $MNT
  local ep="http://127.0.0.1:$PPORT" cache=${2:-$WORK/cache-$RANDOM$RANDOM}
  case $1 in
    s3csi|s3csi-remount) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style \
      --cache-dir "$cache" bench "$MNT" ;;
    s3csi-ignore) "${CLIENT[@]}" "$WORK/s3csi" mount --foreground --endpoint-url "$ep" --force-path-style --ignore-metadata bench "$MNT" ;;
    baseline) "${CLIENT[@]}" "$WORK/baseline" mount --foreground --endpoint-url "$ep" --force-path-style bench "$MNT" ;;
    baseline-ignore) "${CLIENT[@]}" "$WORK/baseline" mount --foreground --endpoint-url "$ep" --force-path-style --ignore-metadata bench "$MNT" ;;
    s3fs) "${CLIENT[@]}" s3fs bench "$MNT" -f -o "url=$ep,use_path_request_style,passwd_file=$WORK/passwd-s3fs" ;;
  esac >>"$WORK/$1.log" 2>&1 &
  wait_mounted "$1"
}

CLIENTS="s3csi s3csi-remount s3csi-ignore"
[ -n "$BASELINE" ] && CLIENTS="$CLIENTS baseline baseline-ignore"
command -v s3fs >/dev/null && CLIENTS="$CLIENTS s3fs"
declare -A T
for run in $(seq "$RUNS"); do
  for c in $CLIENTS; do
    for tree in tree mtree; do
      if [ "$c" = s3csi-remount ]; then
        # A first walk (not timed), unmounted; the timed walk is the next mount's.
        mount_one "$c" "$WORK/cache-remount-$run-$tree" || continue
        "${CLIENT[@]}" ls -laR "$MNT/$tree" >/dev/null 2>&1
        umount_one
        mount_one "$c" "$WORK/cache-remount-$run-$tree" || continue
      else
        mount_one "$c" || continue
      fi
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
